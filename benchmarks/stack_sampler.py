"""Where a Python process spends its wall time, by sampling every thread's stack (a poor man's py-spy,
which the GPU machine does not have): low overhead, so it can watch a server start up without
distorting what it measures the way cProfile does (Dynamo and Inductor are pure Python).

    python3 benchmarks/stack_sampler.py --out stacks.txt [--interval-ms 5] -- -m cosyserve.cli serve ...
    python3 benchmarks/stack_sampler.py --report stacks.txt [--until 45] [--thread MainThread] [--top 30]

The first form runs the module (or script) after ``--`` in this process while a daemon thread samples
``sys._current_frames()`` every ``interval`` ms (for ``--max-s`` seconds) and writes, every few seconds and
at exit, one line per distinct sample: ``second<TAB>thread<TAB>frame;frame;...<TAB>count`` (outermost frame
first, ``file:function``; ``second`` = whole seconds since the start). To keep the file small a stack keeps
its cosyserve frames and the ``--leaf`` innermost frames below the last of them (``...`` marks a cut). The second form summarises such a file:
for each thread, the share of samples whose stack contains each function (inclusive), restricted to
samples taken before ``--until`` seconds, so the phases of a start-up (load, compile, capture) show.
"""

from __future__ import annotations

import argparse
import collections
import os
import runpy
import sys
import threading
import time


def _frame_name(frame) -> str:
    code = frame.f_code
    path = code.co_filename
    for marker in ("site-packages/", "cosyserve/", "lib/python3"):
        i = path.find(marker)
        if i >= 0:
            path = path[i + len(marker) if marker != "cosyserve/" else i:]
            break
    return f"{path}:{code.co_name}"


class Sampler:
    """Samples all threads' Python stacks every ``interval_s`` into ``counts`` (see the module doc)."""

    def __init__(self, out: str, interval_s: float = 0.005, flush_s: float = 5.0, max_s: float = 1e9, leaf: int = 8):
        self.out, self.interval_s, self.flush_s, self.max_s, self.leaf = out, interval_s, flush_s, max_s, leaf
        self.counts: collections.Counter = collections.Counter()
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def _run(self) -> None:
        me = threading.get_ident()
        last_flush = time.monotonic()
        while not self._stop.wait(self.interval_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            elapsed = time.monotonic() - self.t0
            if elapsed > self.max_s:
                break
            sec = int(elapsed)
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = []
                while frame is not None:
                    stack.append(_frame_name(frame))
                    frame = frame.f_back
                self.counts[(sec, names.get(ident, str(ident)), self._compact(stack[::-1]))] += 1
            if time.monotonic() - last_flush > self.flush_s:
                self.flush()
                last_flush = time.monotonic()

    def _compact(self, stack: list[str]) -> str:
        """Cosyserve frames (and the entry frame) plus the innermost ``leaf`` frames after the last one."""
        last = max((i for i, f in enumerate(stack) if f.startswith("cosyserve/")), default=0)
        head = [f for i, f in enumerate(stack[:last + 1]) if i == 0 or f.startswith("cosyserve/")]
        tail = stack[last + 1:]
        if len(tail) > self.leaf:
            tail = ["..."] + tail[-self.leaf:]
        return ";".join(head + tail)

    def flush(self) -> None:
        tmp = self.out + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for (sec, name, stack), n in sorted(self.counts.items()):
                f.write(f"{sec}\t{name}\t{stack}\t{n}\n")
        os.replace(tmp, self.out)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
        self.flush()


def report(path: str, until: float | None, since: float, thread: str | None, top: int) -> None:
    """Print, per thread, the functions found in the most samples (inclusive share) in [since, until)."""
    per_thread: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    with open(path, encoding="utf-8") as f:
        for line in f:
            sec, name, stack, n = line.rstrip("\n").split("\t")
            sec, n = int(sec), int(n)
            if sec < since or (until is not None and sec >= until) or (thread and name != thread):
                continue
            totals[name] += n
            for fn in set(stack.split(";")):
                per_thread[name][fn] += n
    for name, total in totals.most_common():
        print(f"== thread {name}: {total} samples")
        for fn, n in per_thread[name].most_common(top):
            print(f"{100.0 * n / total:6.1f}%  {fn}")


def main() -> None:
    if "--report" in sys.argv:
        ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        ap.add_argument("--report", required=True)
        ap.add_argument("--since", type=float, default=0.0)
        ap.add_argument("--until", type=float, default=None)
        ap.add_argument("--thread", default=None)
        ap.add_argument("--top", type=int, default=40)
        a = ap.parse_args()
        report(a.report, a.until, a.since, a.thread, a.top)
        return
    if "--" not in sys.argv:
        sys.exit("usage: stack_sampler.py --out FILE [--interval-ms MS] -- (-m module | script) args...")
    i = sys.argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--interval-ms", type=float, default=5.0)
    ap.add_argument("--max-s", type=float, default=1e9, help="stop sampling after this many seconds")
    ap.add_argument("--leaf", type=int, default=8, help="innermost non-cosyserve frames kept per stack")
    a = ap.parse_args(sys.argv[1:i])
    rest = sys.argv[i + 1:]
    if not rest:
        sys.exit("nothing to run after --")
    sampler = Sampler(a.out, a.interval_ms / 1e3, max_s=a.max_s, leaf=a.leaf).start()
    try:
        if rest[0] == "-m":
            sys.argv = [rest[1], *rest[2:]]
            runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = rest
            runpy.run_path(rest[0], run_name="__main__")
    finally:
        sampler.stop()


if __name__ == "__main__":
    main()
