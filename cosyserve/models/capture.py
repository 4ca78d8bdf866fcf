"""The process-wide CUDA-graph capture lock, and what a capture that failed leaves behind.

Every CUDA graph capture in cosyserve holds :data:`CAPTURE_LOCK` (:mod:`~cosyserve.models.graphs`,
:mod:`~cosyserve.models.dit_flow`). Besides serialising captures (stages may share a memory pool;
a capture before serving empties the allocator's cache, which torch forbids while any thread
captures), the lock tells *other* threads whether a capture may be under way, because a few
things a serving thread may do invalidate another thread's capture even in
``capture_error_mode="thread_local"``: a device-wide synchronisation — e.g. Triton's
autotuning when a fused kernel (:mod:`~cosyserve.models.fused`) compiles for a new shape — waits
on the capturing stream, which CUDA refuses ("operation not permitted when stream is
capturing") and the capture ends invalid. Seen on an H100 (docs/perf.md, session 22: a fused
Snake compiled on a serving thread while the background capturer recorded an LM graph).
:meth:`CaptureLock.try_hold` lets such code run only while no capture is under way, and hold the
lock meanwhile so that no capture starts under it.

:func:`end_failed_capture`: when CUDA reports a capture invalid, torch's ``CUDAGraph.capture_end``
raises before it tells the caching allocator that the capture's memory pool stopped recording, so
every later capture into that pool fails ("beginAllocateToPool: already recording to mempool_id"),
and before the device's default CUDA generator leaves capture mode. It ends the recording by hand,
*retires* the pool all the same (on the H100, torch 2.11, the pool kept refusing captures even so:
:func:`live_pool` gives the fresh pool that replaces it, which every stage asks for) and restores the
generator (measured: tests/test_gpu.py, docs/perf.md "Session 23").
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager

import torch

log = logging.getLogger(__name__)


class CaptureLock:
    """A re-entrant lock (``threading.RLock`` semantics, usable with ``with``) that also records
    which thread holds it.

    :meth:`held_elsewhere`: another thread holds it (a capture may be under way there).
    :meth:`try_hold`: a context manager yielding True with the lock held when it is free or held
    by this thread, False (without waiting, lock not held) when another thread holds it.
    """

    def __init__(self):
        self._lock = threading.RLock()
        self._owner: int | None = None
        self._depth = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        ok = self._lock.acquire(blocking, timeout)
        if ok:
            self._owner = threading.get_ident()
            self._depth += 1
        return ok

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
        self._lock.release()

    def __enter__(self) -> "CaptureLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def held_elsewhere(self) -> bool:
        """True while a thread other than the caller holds the lock."""
        owner = self._owner
        return owner is not None and owner != threading.get_ident()

    @contextmanager
    def try_hold(self):
        """Hold the lock for the ``with`` body if that needs no waiting (see the class doc)."""
        if not self.acquire(blocking=False):
            yield False
            return
        try:
            yield True
        finally:
            self.release()


#: one capture at a time in the process (see the module doc); every capture in cosyserve holds it
CAPTURE_LOCK = CaptureLock()


def end_failed_capture(device=None, pool=None) -> None:
    """After a capture on ``device`` failed (``capture_end`` raised), end the recording of its memory
    pool ``pool`` (the id passed to ``capture_begin``; torch's ``graph.pool()`` refuses after a
    failed capture) in torch's caching allocator, so that later captures into the same pool work,
    and restore the device's default CUDA generator (see the module doc). Without ``pool`` (a
    private pool) only the generator: such a pool is never captured into again. Harmless when
    nothing records (torch's check is swallowed)."""
    dev = torch.device(device).index if device is not None else None
    if dev is None:
        dev = torch.cuda.current_device()
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None and pool is not None:
        try:
            end(dev, pool)
        except Exception as exc:  # noqa: BLE001 - not recording any more
            log.debug("ending the failed capture's pool recording: %s", exc)
    if pool is not None:
        # ending the recording by hand did not suffice on the H100 (torch 2.11: the next capture into
        # the pool still raised "already recording"): later captures go to a fresh pool (live_pool)
        _replaced_pools[_pool_key(pool)] = torch.cuda.graph_pool_handle()
    _repair_default_generator(dev)


#: memory pools retired after a failed capture -> the pool later captures use instead
_replaced_pools: dict = {}


def _pool_key(pool):
    return tuple(pool) if isinstance(pool, (tuple, list)) else pool


def live_pool(pool):
    """The pool to capture into for ``pool``: itself, or the fresh pool that replaced it after a
    failed capture (:func:`end_failed_capture`; followed through repeated replacements)."""
    seen = 0
    while pool is not None and _pool_key(pool) in _replaced_pools and seen < 1000:
        pool = _replaced_pools[_pool_key(pool)]
        seen += 1
    return pool


def _repair_default_generator(dev: int) -> None:
    """``capture_end`` also raises before the capture's epilogue of the device's default CUDA
    generator, which then stays in capture mode: every later draw from it outside a capture fails
    ("Offset increment outside graph capture encountered unexpectedly"). One small capture run to
    its end runs that epilogue. Tried only when a probe draw fails."""
    try:
        torch.empty(1, device=f"cuda:{dev}").normal_()
        return
    except RuntimeError:
        pass
    t = torch.zeros(1, device=f"cuda:{dev}")
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(side):
            g.capture_begin(capture_error_mode="thread_local")
            try:
                t.add_(1)
            finally:
                g.capture_end()
        torch.empty(1, device=f"cuda:{dev}").normal_()
    except Exception as exc:  # noqa: BLE001 - report, the caller's error is the one that matters
        log.warning("could not restore the default CUDA generator after a failed capture: %s", exc)


def graph_pool_free_bytes(device) -> int:
    """Bytes the caching allocator holds on ``device`` in CUDA-graph memory pools without a live
    tensor in them (0 off CUDA).

    A graph's private pool keeps every block its capture used, freed ones included (a replay writes
    them again), and no allocation outside the pool can take them, so for what remains free on the
    device they count as held; the default pool's cached free blocks do not (the allocator hands
    them out, and empties them before it reports running out of memory). Read from
    ``torch.cuda.memory_snapshot()`` (segments whose ``segment_pool_id`` is not the default
    ``(0, 0)``: ``total_size - allocated_size``); it lists every segment, so callers should cache the
    figure (it only changes when graphs are captured)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return 0
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    free = 0
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device", idx) != idx or tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0):
            continue
        free += int(seg["total_size"]) - int(seg["allocated_size"])
    return free
