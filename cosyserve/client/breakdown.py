"""Where the time goes: engine stage times and first-chunk phases for ``cosyserve bench``.

The engine reports the device time of each batched stage (``prefill``, ``decode``, ``flow``,
``hift``) and, per request, how its first-chunk latency splits into scheduler phases
(``queue``, ``prefill``, ``decode``, ``t2w_wait``, ``token2wav``; see
:class:`cosyserve.engine.request.RequestFinished`). The same numbers reach the benchmark two
ways, as :class:`EngineCounters` snapshots:

* in-process: :class:`EngineCounters` is the engine's observer;
* a server: its Prometheus ``/metrics`` (``cosyserve_stage_seconds``, ``cosyserve_stage_items_total``,
  ``cosyserve_first_chunk_phase_seconds``), scraped before and after each level.

The difference of two snapshots gives, per level, the mean device time per stage call, the
mean batch size, the mean time per phase of the first chunk, and the share of wall time the
engine's scheduler thread spent in each of its phases (``cosyserve_scheduler_host_seconds``:
issuing prefill/decode, waiting for the LM's log-probs, sampling, issuing/waiting for/handing
out token2wav batches; the rest is idle or bookkeeping).
"""

from __future__ import annotations

import copy
import threading
import time

STAGES = ("prefill", "decode", "flow", "hift")
PHASES = ("queue", "prefill", "decode", "t2w_wait", "token2wav")
HOST = ("prefill", "decode", "lm_sync", "sampling", "t2w_launch", "t2w_sync", "emit")


class EngineCounters:
    """Cumulative counts: ``stages[name] = [calls, seconds, items]``, ``phases[name] = [n, seconds]``,
    ``host[phase] = seconds`` of the scheduler thread; ``t``: when the snapshot was taken (monotonic s).

    Has the :class:`~cosyserve.engine.core.EngineObserver` hooks, so it can observe an
    engine directly (thread-safe: the engine thread writes, the benchmark reads snapshots).
    """

    def __init__(self):
        self.stages: dict[str, list[float]] = {}
        self.phases: dict[str, list[float]] = {}
        self.host_s: dict[str, float] = {}
        self.t = time.monotonic()
        self._lock = threading.Lock()

    # EngineObserver hooks
    def lm_step(self, *args) -> None: ...

    def token2wav_step(self, *args) -> None: ...

    def chunk(self, *args) -> None: ...

    def stage(self, name: str, batch_size: int, seconds: float) -> None:
        with self._lock:
            c = self.stages.setdefault(name, [0, 0.0, 0])
            c[0] += 1
            c[1] += seconds
            c[2] += batch_size

    def host(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.host_s[phase] = self.host_s.get(phase, 0.0) + seconds

    def finished(self, event) -> None:
        with self._lock:
            for name, sec in (event.first_chunk_breakdown or {}).items():
                c = self.phases.setdefault(name, [0, 0.0])
                c[0] += 1
                c[1] += sec

    # snapshots
    def snapshot(self) -> "EngineCounters":
        with self._lock:
            out = EngineCounters()
            out.stages, out.phases = copy.deepcopy(self.stages), copy.deepcopy(self.phases)
            out.host_s = dict(self.host_s)
        return out

    @classmethod
    def from_metrics(cls, text: str) -> "EngineCounters":
        """Parse a cosyserve ``/metrics`` page (Prometheus text format)."""
        from prometheus_client.parser import text_string_to_metric_families

        out = cls()
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "cosyserve_stage_seconds_count":
                    out.stages.setdefault(s.labels["stage"], [0, 0.0, 0])[0] = s.value
                elif s.name == "cosyserve_stage_seconds_sum":
                    out.stages.setdefault(s.labels["stage"], [0, 0.0, 0])[1] = s.value
                elif s.name == "cosyserve_stage_items_total":
                    out.stages.setdefault(s.labels["stage"], [0, 0.0, 0])[2] = s.value
                elif s.name == "cosyserve_first_chunk_phase_seconds_count":
                    out.phases.setdefault(s.labels["phase"], [0, 0.0])[0] = s.value
                elif s.name == "cosyserve_first_chunk_phase_seconds_sum":
                    out.phases.setdefault(s.labels["phase"], [0, 0.0])[1] = s.value
                elif s.name == "cosyserve_scheduler_host_seconds_total":
                    out.host_s[s.labels["phase"]] = s.value
        return out


def level_breakdown(before: EngineCounters | None, after: EngineCounters | None) -> dict | None:
    """Per-level means from two snapshots (None if either is missing or nothing ran):
    ``{"stages": {name: {"calls", "mean_ms", "mean_batch"}}, "phases": {name: mean_ms},
    "first_chunks": n, "host": {phase: share of the wall time between the snapshots}}``."""
    if before is None or after is None:
        return None
    stages = {}
    for name, (n1, s1, i1) in after.stages.items():
        n0, s0, i0 = before.stages.get(name, [0, 0.0, 0])
        n = n1 - n0
        if n > 0:
            stages[name] = {"calls": int(n), "mean_ms": (s1 - s0) / n * 1000, "mean_batch": (i1 - i0) / n}
    phases, n_first = {}, 0
    for name, (n1, s1) in after.phases.items():
        n0, s0 = before.phases.get(name, [0, 0.0])
        if n1 - n0 > 0:
            phases[name] = (s1 - s0) / (n1 - n0) * 1000
            n_first = max(n_first, int(n1 - n0))
    if not stages and not phases:
        return None
    wall = after.t - before.t
    host = {name: (sec - before.host_s.get(name, 0.0)) / wall for name, sec in after.host_s.items()} if wall > 0 else {}
    return {"stages": stages, "phases": phases, "first_chunks": n_first, "host": host}


def breakdown_markdown(levels: list[dict]) -> list[str]:
    """Markdown lines of the stage and first-chunk phase tables (empty if no level has them)."""
    rows = [(lv["concurrency"], lv["breakdown"]) for lv in levels if lv.get("breakdown")]
    if not rows:
        return []

    def st(b, name):
        s = b["stages"].get(name)
        return "–" if not s else f"{s['mean_ms']:.1f} (×{s['mean_batch']:.1f})"

    def ph(b, name):
        v = b["phases"].get(name)
        return "–" if v is None else f"{v:.0f}"

    lines = ["", "Engine stages — mean device time per batched call in ms (mean batch size):", "",
             "| clients | prefill | decode step | flow (10 steps, CFG) | HiFT |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {c} | " + " | ".join(st(b, n) for n in STAGES) + " |" for c, b in rows]
    lines += ["", "First-chunk latency by phase — mean ms: queue (arrival → prefill starts), prefill (→ first "
                  "token), decode (→ the chunk's tokens are there), t2w wait (→ its token2wav batch starts), "
                  "token2wav (→ chunk emitted):", "",
              "| clients | queue | prefill | decode | t2w wait | token2wav | sum |", "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {c} | " + " | ".join(ph(b, n) for n in PHASES) + f" | {sum(b['phases'].values()):.0f} |"
              for c, b in rows]
    host_rows = [(c, b["host"]) for c, b in rows if b.get("host")]
    if host_rows:
        lines += ["", "Scheduler thread — % of wall time by phase (issuing prefill / decode, waiting for the "
                      "log-probs, sampling, issuing / waiting for / handing out token2wav batches; other = idle "
                      "and bookkeeping):", "",
                  "| clients | " + " | ".join(HOST) + " | other |", "|---:|" + "---:|" * (len(HOST) + 1)]
        lines += [f"| {c} | " + " | ".join(f"{100 * h.get(n, 0.0):.0f}" for n in HOST)
                  + f" | {100 * max(0.0, 1 - sum(h.values())):.0f} |" for c, h in host_rows]
    return lines
