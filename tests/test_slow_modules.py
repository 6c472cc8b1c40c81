"""The slow modules that `make test-fast` leaves out are named by path (tests/conftest.py:
SLOW_MODULES); a module renamed or removed must leave the list, or the list would silently stop
marking what it meant to."""

from __future__ import annotations

import pathlib

from tests.conftest import SLOW_MODULES

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_slow_module_exists():
    missing = [m for m in SLOW_MODULES if not (ROOT / m).is_file()]
    assert not missing, missing
    assert len(set(SLOW_MODULES)) == len(SLOW_MODULES)
