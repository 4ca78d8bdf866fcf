"""The capture lock (cosyserve.models.capture) and what fused kernels do while another thread
captures a CUDA graph; the CUDA side (a failed capture's pool) is in tests/test_gpu.py (gpu)."""

from __future__ import annotations

import threading

import torch

from cosyserve.models import capture as C
from cosyserve.models import fused as F


def _in_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", fn()))
    t.start()
    t.join(10)
    return out["v"]


def test_lock_reports_who_holds_it():
    lock = C.CaptureLock()
    assert not lock.held_elsewhere()
    with lock:
        with lock:  # re-entrant
            assert not lock.held_elsewhere()
            assert _in_thread(lock.held_elsewhere)
            with lock.try_hold() as free:  # this thread holds it: no waiting
                assert free
            assert _in_thread(lambda: lock.acquire(blocking=False)) is False
        assert _in_thread(lock.held_elsewhere)  # still held once
    assert not lock.held_elsewhere() and not _in_thread(lock.held_elsewhere)

    def other():
        with lock.try_hold() as free:
            return free

    assert _in_thread(other)  # free again
    release, holding = threading.Event(), threading.Event()

    def hold():
        with lock:
            holding.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert holding.wait(10)
    with lock.try_hold() as free:
        assert free is False  # another thread holds it: told at once, not blocked
    release.set()
    t.join(10)
    with lock.try_hold() as free:
        assert free


class _FakeCuda:
    """Stands in for a CUDA tensor (FusedOp only asks ``is_cuda``)."""

    is_cuda = True


def test_fused_op_runs_eagerly_while_another_thread_captures(monkeypatch):
    """While another thread holds the capture lock a fused op runs its eager formula (compiling or
    autotuning then would synchronise the device and invalidate that capture); otherwise the
    compiled one, holding the lock meanwhile so that no capture starts under it."""
    monkeypatch.setattr(F, "_triton_available", lambda: True)
    held_during_compiled = []

    def compiled(x):
        held_during_compiled.append(C.CAPTURE_LOCK._owner == threading.get_ident())
        return "compiled"

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled)
    op = F.FusedOp(lambda x: "eager", name="t")
    x = _FakeCuda()
    assert op(x) == "compiled" and held_during_compiled == [True]
    release, holding = threading.Event(), threading.Event()

    def capture_elsewhere():
        with C.CAPTURE_LOCK:
            holding.set()
            release.wait(10)

    t = threading.Thread(target=capture_elsewhere)
    t.start()
    try:
        assert holding.wait(10)
        assert op(x) == "eager"  # not compiled, not marked broken
        assert not op._broken
    finally:
        release.set()
        t.join(10)
    assert op(x) == "compiled"
    with C.CAPTURE_LOCK:  # this thread capturing (the capture's own fused calls): compiled
        assert op(x) == "compiled"


def test_end_failed_capture_ends_the_pool_recording(monkeypatch):
    calls, repaired = [], []
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda dev, pool: calls.append((dev, pool)), raising=False)
    monkeypatch.setattr(C, "_repair_default_generator", repaired.append)  # CUDA: tests/test_gpu.py
    fresh = iter([(0, 100), (0, 101), (0, 102)])
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(fresh))
    monkeypatch.setattr(C, "_replaced_pools", {})

    C.end_failed_capture("cuda:1", (0, 7))
    assert calls == [(1, (0, 7))] and repaired == [1]
    assert C.live_pool((0, 7)) == (0, 100) and C.live_pool((0, 8)) == (0, 8)  # retired: captures go elsewhere
    C.end_failed_capture("cuda:1", (0, 100))  # its successor fails too: followed through
    assert C.live_pool((0, 7)) == (0, 101)
    calls.clear()
    C.end_failed_capture("cuda:0")  # a private pool: nothing to end, the generator restored
    assert calls == [] and repaired == [1, 1, 0]

    def refuse(dev, pool):
        raise RuntimeError("endAllocatePool: not currently recording")

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", refuse, raising=False)
    C.end_failed_capture("cuda:0", (0, 7))  # not recording: swallowed


def test_graphs_use_the_one_capture_lock():
    from cosyserve.models import graphs as G

    assert G.CAPTURE_LOCK is C.CAPTURE_LOCK and G._CAPTURE_LOCK is C.CAPTURE_LOCK



def test_only_the_capture_thread_compiles_while_it_runs(monkeypatch):
    """While a background capturer owns compiling (fused.compile_only_on), other threads run fused
    ops eagerly (no compile stalls, no device-wide syncs under its captures); its thread and, once
    it ends, every thread run them compiled."""
    monkeypatch.setattr(F, "_triton_available", lambda: True)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: (lambda x: "compiled"))
    op = F.FusedOp(lambda x: "eager", name="t2")
    x = _FakeCuda()
    owner = threading.Thread(target=lambda: None)
    owner.start()
    owner.join()
    try:
        F.compile_only_on(owner.ident)
        assert op(x) == "eager" and op._compiled is None  # not even compiled on this thread
        F.compile_only_on(threading.get_ident())
        assert op(x) == "compiled"
    finally:
        F.compile_only_on(None)
    assert _in_thread(lambda: op(x)) == "compiled"
