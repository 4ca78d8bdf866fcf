"""Where the slow first chunks of a benchmark come from, per request, from a `cosyserve serve` log.

Every finished request logs one ``event=finish`` line with its ``first_chunk_ms`` and the engine's
phases of it (``first_chunk_queue_ms``, ``_prefill_ms``, ``_decode_ms``, ``_t2w_wait_ms``,
``_token2wav_ms``: arrival -> prefill starts -> first token -> the chunk's tokens are there -> its
token2wav batch starts -> the chunk is emitted; :class:`~cosyserve.engine.request.RequestFinished`).
This reads those lines (text or JSON log format), groups the requests into levels (with ``--report``, the
bench's ``report.json`` on the same machine: by each level's ``started_at``, labelled with its role and
clients; otherwise a new level after ``--gap`` seconds without an arrival: a capacity search with listening
clients drains each level before the next, back-to-back clients may not leave such a gap),
and prints per level and per ``--window`` seconds of arrival time the count, first-chunk mean / max
and the mean of each phase, then the phases of the slowest ``--tail`` share of the level's requests.
The mean breakdown of ``cosyserve bench`` cannot tell a ramp-end queue from slow compute; this can.

    python3 benchmarks/first_chunk_tail.py OUT/server.log [--window 2] [--gap 2] [--tail 0.02]
    python3 benchmarks/first_chunk_tail.py OUT/server.log.gz --min-requests 100   # capacity levels only
    python3 benchmarks/first_chunk_tail.py OUT/server.log --report OUT/capacity/report.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import re
import statistics
import sys

PHASES = ("queue", "prefill", "decode", "t2w_wait", "token2wav")
_TEXT = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*event=finish (.*)$")


def parse(lines) -> list[dict]:
    """The requests that finished ``ok`` with a first chunk: per request ``arrival`` (epoch
    seconds: log time - total), ``first_ms`` and ``phases`` (ms per phase; empty for older logs)."""
    out = []
    for line in lines:
        rec = None
        if line.startswith("{"):
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if d.get("event") == "finish":
                rec = (float(d["ts"]), d)
        else:
            m = _TEXT.match(line)
            if m:
                t = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1000
                rec = (t, dict(kv.split("=", 1) for kv in m.group(3).split() if "=" in kv))
        if rec is None:
            continue
        t, d = rec
        if d.get("outcome") != "ok" or d.get("first_chunk_ms") in (None, "None"):
            continue
        phases = {p: float(d[f"first_chunk_{p}_ms"]) for p in PHASES if f"first_chunk_{p}_ms" in d}
        out.append({"arrival": t - float(d["total_ms"]) / 1000, "first_ms": float(d["first_chunk_ms"]),
                    "phases": phases})
    out.sort(key=lambda r: r["arrival"])
    return out


def levels(reqs: list[dict], gap: float) -> list[list[dict]]:
    """``reqs`` (sorted by arrival) split where no request arrived for ``gap`` seconds."""
    groups: list[list[dict]] = []
    for r in reqs:
        if not groups or r["arrival"] - groups[-1][-1]["arrival"] > gap:
            groups.append([])
        groups[-1].append(r)
    return groups


def report_levels(reqs: list[dict], bench_levels: list[dict], lead_s: float = 0.5) -> list[tuple[str, list[dict]]]:
    """``reqs`` (sorted by arrival) split by a bench report's levels (``report.json``'s ``levels``, each with
    ``started_at`` in Unix seconds): level i takes the requests that arrived from its start (less ``lead_s``, the
    clocks' and the log's rounding) until the next level's; ``[(label, requests)]`` in the report's order, the
    label ``"probe, 96 clients"``; levels without ``started_at`` (older reports) are skipped."""
    marks = [(lv["started_at"], f"{lv.get('role', 'level')}, {lv['concurrency']} clients") for lv in bench_levels
             if lv.get("started_at") is not None]
    out = []
    for i, (t0, label) in enumerate(marks):
        t1 = marks[i + 1][0] if i + 1 < len(marks) else float("inf")
        out.append((label, [r for r in reqs if t0 - lead_s <= r["arrival"] < t1 - lead_s]))
    return out


def _row(label: str, rs: list[dict]) -> str:
    first = [r["first_ms"] for r in rs]
    ph = [f"{statistics.mean(r['phases'][p] for r in rs if p in r['phases']):.0f}"
          if any(p in r["phases"] for r in rs) else "–" for p in PHASES]  # "–": a log from before the phases
    return f"| {label} | {len(rs)} | {statistics.mean(first):.0f} | {max(first):.0f} | " + " | ".join(ph) + " |"


def report(reqs: list[dict], window: float, gap: float, tail: float, min_requests: int,
           bench_levels: list[dict] | None = None) -> list[str]:
    """Markdown lines: one table per level with at least ``min_requests`` requests (levels split by
    ``bench_levels``, :func:`report_levels`, or by ``gap``, :func:`levels`)."""
    lines = []
    head = ("| arrival window | requests | first chunk mean | max | " + " | ".join(PHASES) + " |",
            "|---|---:|---:|---:|" + "---:|" * len(PHASES))
    groups = report_levels(reqs, bench_levels) if bench_levels else [(None, lv) for lv in levels(reqs, gap)]
    for label, lv in groups:
        if not lv or len(lv) < min_requests:
            continue
        t0 = lv[0]["arrival"]
        start = dt.datetime.fromtimestamp(t0).strftime("%H:%M:%S")
        lines += ["", f"Level {'' if label is None else f'({label}) '}from {start}: {len(lv)} requests over "
                      f"{lv[-1]['arrival'] - t0:.1f} s (first chunk and phases in ms, means unless named):", "", *head]
        n_win = int((lv[-1]["arrival"] - t0) // window) + 1
        for i in range(n_win):
            rs = [r for r in lv if i * window <= r["arrival"] - t0 < (i + 1) * window]
            if rs:
                lines.append(_row(f"{i * window:g}-{(i + 1) * window:g} s", rs))
        k = max(1, round(tail * len(lv)))
        slow = sorted(lv, key=lambda r: r["first_ms"])[-k:]
        at = ", ".join(f"{r['arrival'] - t0:.1f}" for r in slow[-5:])
        lines.append(_row(f"slowest {k} (arrived at {at} s)", slow))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="the server's log (text or JSON lines; .gz read as such)")
    ap.add_argument("--window", type=float, default=2.0, help="seconds of arrival time per row (default 2)")
    ap.add_argument("--gap", type=float, default=2.0, help="a new level after this many seconds without an arrival")
    ap.add_argument("--tail", type=float, default=0.02, help="share of each level's slowest requests (default 0.02)")
    ap.add_argument("--min-requests", type=int, default=20, help="skip levels with fewer requests (default 20)")
    ap.add_argument("--report", help="the bench's report.json: split the levels at its levels' starts (not --gap)")
    args = ap.parse_args(argv)
    bench_levels = None
    if args.report:
        try:
            with open(args.report, encoding="utf-8") as f:
                bench_levels = json.load(f)["levels"]
        except (OSError, ValueError, KeyError) as exc:
            print(f"{args.report}: cannot read the bench's levels ({exc})", file=sys.stderr)
            return 2
    opener = gzip.open if args.log.endswith(".gz") else open
    with opener(args.log, "rt", errors="replace") as f:
        reqs = parse(f)
    if not reqs:
        print(f"{args.log}: no finished requests with a first chunk (event=finish lines)", file=sys.stderr)
        return 1
    print("\n".join(report(reqs, args.window, args.gap, args.tail, args.min_requests, bench_levels)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
