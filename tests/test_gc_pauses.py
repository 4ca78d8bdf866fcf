"""The garbage-collection helpers of cosyserve.engine.gc_pauses."""

from __future__ import annotations

import gc
import logging

from cosyserve.engine.gc_pauses import GCPauseMonitor, freeze_startup_heap


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
