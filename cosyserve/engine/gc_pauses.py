"""Python garbage-collector pauses: keep the startup heap out of them, and measure them.

A full (generation 2) collection walks every tracked Python object while holding the GIL,
which stops the scheduler thread and the server's event loop alike. After start-up the heap
holds a great many long-lived objects that collections can never free — loaded modules,
``torch.compile``'s FX graphs and guards, transformers' tokenizer tables, CUDA-graph
bookkeeping — and a full collection over them took about a third of a second on the
benchmark server (docs/perf-history.md, run 27: a burst of 32 new streams waited ~360 ms before
reaching the engine). :func:`freeze_startup_heap` moves everything alive at that point into
the permanent generation (``gc.freeze``, as CPython's documentation recommends for servers
after initialisation), so later collections only walk objects created while serving.

Long-lived objects also appear *after* ready: the background CUDA-graph capture (issue 18) compiles
and captures for minutes while the server serves, and every graph leaves its FX graphs, guards and
bookkeeping behind. On the H100 (docs/perf.md "Session 30") full collections after that capture
took 157-165 ms while 128 DiT streams were running, and each such pause stalled the streams whose
next chunk was due within it (45 of 384 at one level). The server therefore freezes the heap again
when the capture ends (:func:`freeze_heap`, no collection first: a collection then would be the very
pause to avoid), and :class:`GCPauseMonitor` can re-freeze after a full collection that took longer
than ``refreeze_s`` (a new voice's graphs captured later, for instance), at most once per
``refreeze_interval_s``. What a freeze costs: cyclic garbage among the frozen objects is never
collected (objects freed by reference counting are freed as always); a few re-freezes per hour
bound that.

:class:`GCPauseMonitor` times every collection (``gc.callbacks``), reports it to an observer
(the server's ``cosyserve_gc_pause_seconds`` histogram) and logs a warning for long ones.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect garbage once, then exclude every surviving object from future collections
    (``gc.freeze``). Call after models are loaded and warmed up. Returns the number of objects
    frozen in total."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def freeze_heap() -> int:
    """Exclude every object alive now from future collections (``gc.freeze``) *without* collecting
    first (for a server already serving: see the module doc). Returns how many objects this call
    froze (the permanent generation's growth)."""
    before = gc.get_freeze_count()
    gc.freeze()
    return gc.get_freeze_count() - before


class GCPauseMonitor:
    """Times garbage collections via ``gc.callbacks``.

    ``observe(generation, seconds)`` (optional) is called after every collection; collections
    longer than ``warn_s`` seconds are logged as warnings. :meth:`install` / :meth:`uninstall`
    add and remove the callback (idempotent). ``max_s`` and ``count`` summarise what was seen.

    ``refreeze_s`` (seconds, None = never): after a generation-2 collection that took longer, the
    survivors are frozen (:func:`freeze_heap`), at most once per ``refreeze_interval_s`` seconds
    (``clock``: the time source); ``refreezes`` counts them. Raises ValueError for a negative
    ``warn_s``, ``refreeze_s`` or interval.
    """

    def __init__(self, observe=None, warn_s: float = 0.05, refreeze_s: float | None = None,
                 refreeze_interval_s: float = 300.0, clock=time.monotonic):
        if warn_s < 0 or (refreeze_s is not None and refreeze_s < 0) or refreeze_interval_s < 0:
            raise ValueError("GCPauseMonitor needs warn_s, refreeze_s and refreeze_interval_s >= 0")
        self.observe = observe
        self.warn_s = warn_s
        self.refreeze_s, self.refreeze_interval_s, self.clock = refreeze_s, refreeze_interval_s, clock
        self.count = 0
        self.max_s = 0.0
        self.refreezes = 0
        self._last_refreeze: float | None = None
        self._t0: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        if self._t0 is None:
            return
        dt, self._t0 = time.perf_counter() - self._t0, None
        gen = int(info.get("generation", -1))
        self.count += 1
        self.max_s = max(self.max_s, dt)
        if self.observe is not None:
            self.observe(gen, dt)
        frozen = 0
        if gen == 2 and self.refreeze_s is not None and dt > self.refreeze_s:
            now = self.clock()
            if self._last_refreeze is None or now - self._last_refreeze >= self.refreeze_interval_s:
                self._last_refreeze = now
                frozen = freeze_heap()  # the collection just ran: what is left is alive
                self.refreezes += 1
        if dt > self.warn_s:
            log.warning("garbage collection of generation %d took %.0f ms (%d objects collected)%s",
                        gen, dt * 1e3, int(info.get("collected", 0)),
                        f"; froze the {frozen} survivors out of later collections" if frozen else "")

    def install(self) -> "GCPauseMonitor":
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
