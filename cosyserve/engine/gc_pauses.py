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


class GCPauseMonitor:
    """Times garbage collections via ``gc.callbacks``.

    ``observe(generation, seconds)`` (optional) is called after every collection; collections
    longer than ``warn_s`` seconds are logged as warnings. :meth:`install` / :meth:`uninstall`
    add and remove the callback (idempotent). ``max_s`` and ``count`` summarise what was seen.
    """

    def __init__(self, observe=None, warn_s: float = 0.05):
        self.observe = observe
        self.warn_s = warn_s
        self.count = 0
        self.max_s = 0.0
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
        if dt > self.warn_s:
            log.warning("garbage collection of generation %d took %.0f ms (%d objects collected)",
                        gen, dt * 1e3, int(info.get("collected", 0)))

    def install(self) -> "GCPauseMonitor":
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
