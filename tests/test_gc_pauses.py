"""The garbage-collection helpers of cosyserve.engine.gc_pauses."""

from __future__ import annotations

import gc
import logging

import pytest

from cosyserve.engine.gc_pauses import GCPauseMonitor, freeze_heap, freeze_startup_heap


def test_monitor_times_collections_and_warns(caplog):
    seen = []
    mon = GCPauseMonitor(lambda gen, s: seen.append((gen, s)), warn_s=0.0).install()
    try:
        mon.install()  # idempotent
        assert gc.callbacks.count(mon._callback) == 1
        with caplog.at_level(logging.WARNING, logger="cosyserve.engine.gc_pauses"):
            gc.collect()
    finally:
        mon.uninstall()
    assert mon._callback not in gc.callbacks
    assert (2, seen[-1][1]) == seen[-1] and seen[-1][1] >= 0 and mon.count >= 1 and mon.max_s >= seen[-1][1]
    assert "garbage collection of generation 2 took" in caplog.text
    n = mon.count
    gc.collect()
    assert mon.count == n  # uninstalled: no longer called


def test_freeze_startup_heap_moves_live_objects_out_of_collections():
    keep = [[i] for i in range(10)]  # tracked containers, alive across the freeze
    assert any(o is keep for o in gc.get_objects())
    try:
        frozen = freeze_startup_heap()
        assert frozen > len(keep) and gc.get_freeze_count() == frozen
        assert not any(o is keep for o in gc.get_objects())  # no collection walks it any more
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_freeze_heap_freezes_without_collecting_and_counts_what_it_froze():
    class Cycle:
        pass

    garbage = Cycle()
    garbage.me = garbage  # cyclic garbage once the name is dropped: a collection would free it
    ref = __import__("weakref").ref(garbage)
    del garbage
    try:
        before = gc.get_freeze_count()
        n = freeze_heap()
        assert n > 0 and gc.get_freeze_count() == before + n
        gc.collect()
        assert ref() is not None  # frozen, not collected: the documented price of a freeze
    finally:
        gc.unfreeze()
    gc.collect()
    assert ref() is None


def _long_collections(mon, times):
    """Feed ``mon`` generation-2 collections of the given durations (seconds) via its callback."""
    import time as _time
    for dt in times:
        mon._callback("start", {"generation": 2})
        mon._t0 = _time.perf_counter() - dt
        mon._callback("stop", {"generation": 2, "collected": 0})


def test_monitor_refreezes_after_a_long_full_collection_at_most_once_per_interval(caplog):
    now = [100.0]
    mon = GCPauseMonitor(refreeze_s=0.05, refreeze_interval_s=60.0, clock=lambda: now[0])
    try:
        with caplog.at_level(logging.WARNING, logger="cosyserve.engine.gc_pauses"):
            _long_collections(mon, [0.01])  # short: nothing frozen
            assert mon.refreezes == 0 and gc.get_freeze_count() == 0
            _long_collections(mon, [0.2])
            assert mon.refreezes == 1 and gc.get_freeze_count() > 0
            assert "froze the" in caplog.text and "survivors out of later collections" in caplog.text
            now[0] += 30
            _long_collections(mon, [0.2])  # within the interval: no second freeze
            assert mon.refreezes == 1
            now[0] += 31
            _long_collections(mon, [0.2])
            assert mon.refreezes == 2
        mon._callback("start", {"generation": 1})
        mon._t0 -= 1.0
        mon._callback("stop", {"generation": 1})
        assert mon.refreezes == 2  # only full collections
    finally:
        gc.unfreeze()
    assert GCPauseMonitor().refreeze_s is None  # off unless asked for
    with pytest.raises(ValueError):
        GCPauseMonitor(refreeze_s=-1)
