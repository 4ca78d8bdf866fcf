"""A one-line progress bar on stderr (no dependency; silent when stderr is not a terminal)."""

from __future__ import annotations

import sys
import threading
import time


class Progress:
    """``[#####-----]  12/40  ok 12  failed 0  3.2 s  <label>``, redrawn at most 10 times a second.

    Thread-safe: :meth:`advance` may be called from worker threads. ``enabled=None`` means
    "only when stderr is a terminal".
    """

    WIDTH = 28

    def __init__(self, total: int, label: str = "", enabled: bool | None = None, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = (self.stream.isatty() if enabled is None else enabled) and total > 0
        self.total, self.label = total, label
        self.done = self.failed = 0
        self.t0 = time.perf_counter()
        self._last = 0.0
        self._lock = threading.Lock()
        self._draw(force=True)

    def advance(self, ok: bool = True) -> None:
        with self._lock:
            self.done += 1
            self.failed += 0 if ok else 1
            self._draw(force=self.done >= self.total)

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        fill = int(self.WIDTH * self.done / self.total)
        bar = "#" * fill + "-" * (self.WIDTH - fill)
        self.stream.write(f"\r[{bar}] {self.done:>4}/{self.total}  ok {self.done - self.failed}  "
                          f"failed {self.failed}  {now - self.t0:6.1f} s  {self.label}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            with self._lock:
                self._draw(force=True)
                self.stream.write("\n")
                self.stream.flush()
