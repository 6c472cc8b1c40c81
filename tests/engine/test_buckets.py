from __future__ import annotations

import pytest

from jaxserve.compiled_step.buckets import BucketGrid, geometric


def test_default_grid():
    g = BucketGrid.build(512, 32)
    assert g.token_buckets == (16, 32, 64, 128, 256, 512)
    assert g.request_buckets == (8, 32)
    assert all(r <= t for t, r in g.shapes())
    assert (16, 8) in g.shapes() and (16, 32) not in g.shapes()


def test_pick_smallest_fitting_bucket():
    g = BucketGrid.build(512, 32)
    assert g.pick(1, 1) == (16, 8)
    assert g.pick(17, 3) == (32, 8)
    assert g.pick(20, 20) == (32, 32)
    assert g.pick(512, 32) == (512, 32)
    with pytest.raises(RuntimeError):
        g.pick(513, 1)


def test_explicit_buckets_must_cover_limits():
    assert geometric(16, 100) == (16, 32, 64, 100)
    with pytest.raises(ValueError):
        BucketGrid.build(512, 32, token_buckets=(16, 256))
