from __future__ import annotations

import re
import time

from jaxserve.startup_timer import StartupTimer, process_age


def test_phases_nest_without_counting_twice():
    t = StartupTimer()
    with t.phase("outer"):
        time.sleep(0.05)
        with t.phase("inner"):
            time.sleep(0.1)
    with t.phase("inner"):  # phases add up
        time.sleep(0.05)
    t.add("server", 0.5)
    t.note("inner", "2 loaded, 0 compiled")
    assert 0.04 < t.phases["outer"] < 0.1 and 0.14 < t.phases["inner"] < 0.25
    summary = t.summary()
    assert summary.startswith("start-up ") and "since the engine build began" in summary
    assert re.search(r"inner 0\.\d\d s \(2 loaded, 0 compiled\)", summary) and "server 0.50 s" in summary
    assert "imports" not in summary


def test_since_launch_counts_what_ran_before_as_imports():
    age = process_age()
    assert age is not None and age > 0  # a test process has been running a while
    t = StartupTimer(since_launch=True)
    assert t.before > 0 and t.elapsed() >= t.before
    assert "since launch: imports" in t.summary()
