"""Asyncio front of the engine: a background thread steps :class:`EngineCore`.

Model compute must not block the event loop that serves HTTP/gRPC, so one dedicated
thread runs ``EngineCore.step()`` while there is work (PyTorch releases the GIL inside
kernels) and sleeps on a condition variable when idle. Each request gets an
``asyncio.Queue`` that the thread fills through ``loop.call_soon_threadsafe``; the
request's async iterator drains it. Leaving the iterator early (client disconnect,
cancellation, ``break``) aborts the request, so its KV slot and caches are freed before
the engine's next step.

The engine thread and the event loop share one GIL. PyTorch releases it around every op, and a
thread that wants it back waits until the holder drops it — up to the interpreter's switch interval
(5 ms by default) while the event loop runs Python (serving many streams, it mostly does). So while an
AsyncEngine runs, the switch interval is at most :data:`ENGINE_SWITCH_INTERVAL_S` (process-wide;
restored at :meth:`AsyncEngine.stop` unless changed meanwhile): the scheduler thread issues hundreds
of small ops per token2wav batch, and each could otherwise wait milliseconds for the GIL
(docs/perf-history.md run 5: a token2wav thread next to the scheduler ran 1.6-2.9x slower at 5 ms).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from ..errors import device_lost
from ..models.graphs import restore_switch_interval, shorten_switch_interval
from .core import EngineCore
from .request import AudioChunk, EngineRequest, Outcome, RequestFinished

log = logging.getLogger(__name__)

#: the GIL switch interval (seconds) while an AsyncEngine runs (module doc)
ENGINE_SWITCH_INTERVAL_S = 2e-4


class AsyncEngine:
    """Runs an :class:`EngineCore` in a background thread for asyncio callers."""

    def __init__(self, core: EngineCore):
        self.core = core
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        #: the first sticky CUDA error a request or step failed with (:func:`cosyserve.errors.device_lost`):
        #: the device context is unusable, so every later request would fail the same way
        self.device_error: BaseException | None = None
        #: called once (on the event loop) with that error; the server stops and exits non-zero so that
        #: its supervisor (the router, systemd, Kubernetes) starts a fresh process
        self.on_device_lost = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread; must be called from the event loop's thread."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stop = False
        self._switch = shorten_switch_interval(ENGINE_SWITCH_INTERVAL_S)  # restored in stop()
        if getattr(self.core, "graph_capturer", None) is not None:
            self.core.when_graphs_captured(self._capture_ended)
        self._thread = threading.Thread(target=self._run, name="cosyserve-engine", daemon=True)
        self._thread.start()

    async def stop(self, drain_timeout: float = 0.0) -> None:
        """Stop the thread. With ``drain_timeout`` > 0, running requests may finish first;
        whatever is left is aborted (its iterators end with an ``aborted`` outcome)."""
        if drain_timeout > 0:
            deadline = asyncio.get_running_loop().time() + drain_timeout
            while self._queues and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
        for rid in list(self._queues):
            self.core.abort(rid, Outcome.ABORTED)
        self._wake()
        await asyncio.sleep(0)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None
            restore_switch_interval(self._switch)
        await asyncio.to_thread(self.core.close)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _run(self) -> None:
        core = self.core
        try:
            # CUDA graphs: the background capturer started (and primed) before any request is
            # served, or with graph_capture="startup" every graph captured first
            core.start_graph_capture()
        except BaseException:  # noqa: BLE001 - buckets not captured run eagerly or are captured on first use
            log.exception("graph warm-up failed")
        while True:
            with self._cv:
                while not self._stop and not core.has_work():
                    self._cv.wait(timeout=0.5)
                if self._stop and not core.has_work():
                    return
            try:
                events = core.step()
            except BaseException as exc:  # an engine bug: fail loudly, keep the process up
                log.exception("engine step failed")
                self.error = exc
                events = []
                for rid in list(self._queues):
                    events.append(RequestFinished(rid, Outcome.ERROR, exc))
                    core.abort(rid, Outcome.ERROR)
            if events and self._loop is not None:
                self._loop.call_soon_threadsafe(self._dispatch, events)

    def _device_lost(self, exc: BaseException) -> None:
        """(On the event loop.) ``exc`` is a sticky CUDA error: record it, call ``on_device_lost`` once."""
        if self.device_error is not None:
            return
        self.device_error = exc
        log.critical("the device context is lost (%s): every later request would fail; this process stops so "
                     "that it can be restarted", exc, extra={"event": "device_lost"})
        if self.on_device_lost is not None:
            self.on_device_lost(exc)

    def _capture_ended(self) -> None:
        """(On the capture thread.) A background graph capture ended by a sticky CUDA error loses
        the device as a failed request does, before any request has to fail for it."""
        err = getattr(self.core.graph_capturer, "error", None)
        if device_lost(err) and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._device_lost, err)

    def _dispatch(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, RequestFinished) and device_lost(ev.error):
                self._device_lost(ev.error)
            q = self._queues.get(ev.request_id)
            if q is not None:
                q.put_nowait(ev)
                if isinstance(ev, RequestFinished):
                    self._queues.pop(ev.request_id, None)

    # ------------------------------------------------------------------ requests
    def submit(self, req: EngineRequest) -> asyncio.Queue:
        """Queue ``req``; returns its event queue. Raises ``QueueFullError``/``InvalidInputError``."""
        if self._loop is None:
            raise RuntimeError("AsyncEngine.start() was not called")
        q: asyncio.Queue = asyncio.Queue()
        self.core.add_request(req)  # raises before the queue of a request with the same id is touched
        self._queues[req.request_id] = q
        self._wake()
        return q

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id, Outcome.ABORTED)
        self._wake()

    def set_admission(self, **changes) -> dict:
        """:meth:`EngineCore.set_admission <cosyserve.engine.core.EngineCore.set_admission>`, the engine
        thread woken to apply it (raises InvalidInputError naming a bad setting)."""
        out = self.core.set_admission(**changes)
        self._wake()
        return out

    def prebuild_prompt_prefixes(self, voices: list) -> bool:
        """:meth:`EngineCore.prebuild_prompt_prefixes <cosyserve.engine.core.EngineCore.prebuild_prompt_prefixes>`,
        the engine thread woken to build them (False: prefix mode off, nothing queued)."""
        queued = self.core.prebuild_prompt_prefixes(voices)
        if queued:
            self._wake()
        return queued

    def reset_admission(self) -> None:
        """:meth:`EngineCore.reset_capacity_model <cosyserve.engine.core.EngineCore.reset_capacity_model>`, the
        engine thread woken to apply it."""
        self.core.reset_capacity_model()
        self._wake()

    async def calibrate_admission(self, requests: list[EngineRequest]) -> int:
        """Run ``requests`` (LM-only, built by the caller: the server's ``--admission-calibrate`` start-up) to
        their end with the capacity model calibrating (:meth:`EngineCore.set_calibrating
        <cosyserve.engine.core.EngineCore.set_calibrating>`: their LM steps feed only its fits of the steps alone),
        all submitted at once (at start-up, before requests of others: the server is not ready yet), the estimator
        calibrating until every one has ended. Returns how many finished without an error; raises the first error
        of :meth:`submit` (the queue full) when none did."""
        async def run(req: EngineRequest) -> bool:
            async for ev in self.generate(req):
                if isinstance(ev, RequestFinished):
                    return ev.error is None and ev.outcome == Outcome.OK
            return False

        self.core.set_calibrating(True)
        try:
            results = await asyncio.gather(*(run(r) for r in requests), return_exceptions=True)
        finally:
            self.core.set_calibrating(False)
            self._wake()
        ok = sum(r is True for r in results)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and not ok:
            raise errors[0]
        return ok

    async def generate(self, req: EngineRequest) -> AsyncIterator[AudioChunk | RequestFinished]:
        """Submit ``req`` and yield its audio chunks, then its :class:`RequestFinished`.

        Stopping the iteration early (or cancelling the task) aborts the request.
        """
        q = self.submit(req)
        done = False
        try:
            while True:
                ev = await q.get()
                if isinstance(ev, RequestFinished):
                    done = True
                    yield ev
                    return
                yield ev
        finally:
            if not done:
                self._queues.pop(req.request_id, None)
                self.abort(req.request_id)
