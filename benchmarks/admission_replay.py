"""Replay an admission trace (``cosyserve serve --admission-trace FILE``) into capacity estimators of other settings.

    python benchmarks/admission_replay.py TRACE [--variant '{"target": 0.9}' ...] [--bucket 0.5] [--start S --end S]

Prints one markdown table: per time window (seconds from the trace's start, and the local time it began: line it up
with a benchmark's level times) the engine's active and waiting requests (most), the close calls and late chunks the
engine saw, the capacity the server computed (least, mean and most: admission admits on the most), and what each
variant's estimator computes from the same measurements (the same three). The first variant column is always the
recording's own settings: it must equal the recorded one (the script says so, or counts the records where it does
not). Open loop (cosyserve/engine/admission.py, "Trace and replay"): a variant that would have admitted more streams
is shown what the recorded streams cost, not what its own would have. Variant keys: the CapacityEstimator's keyword
arguments (target, lm_alone, start_cost, contention_fit, alone_floor, half_life_s, growth, initial, max_streams,
t2w_price).

Around the estimator (the engine's, not fed by a replay of the estimator alone): ``--pace-half-life S`` averages the
recorded LM paces over time as the engine does since session 42 (``PaceAverage``; for traces recorded before, whose
init record has no ``pace_half_life_s``: a trace recorded with it holds the averaged paces already); ``--guard``
adds the slack guard's cap (a ``SlackGuard`` fed the recorded close calls, margin and recovery from the init record
or the defaults, ``--guard-settle`` its settle time; 0 = as before session 42) and the smaller of it and each
column's capacity ("guarded"): open loop too, the close calls are those the recorded admissions caused.

``--batches [--gap S]`` adds what the token2wav batches cost the scheduler thread: host and device seconds by the audio
a batch emitted, and the gaps without an LM step while streams were active with the batch whose launch filled them
(:func:`batch_tables`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosyserve.engine.admission import (PaceAverage, SlackGuard, read_admission_trace,  # noqa: E402
                                        replay_admission_trace)


def _variant(text: str) -> dict:
    try:
        v = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("a variant is a JSON object of estimator settings")
    return v


def with_calibration(records: list[dict], at_s: float, costs: tuple[float, float, float, float],
                     streams: int = 48, step_s: float = 0.003) -> list[dict]:
    """``records`` with the LM steps of a start-up calibration (``serve --admission-calibrate``) inserted ``at_s``
    seconds into the trace: ``streams`` LM-only requests, request ``i`` generating ``8 + i`` tokens, so steps at
    ``streams`` rows for 8 tokens, then one step at each row count down to 1, ``step_s`` apart, between ``cal``
    records; each step costs ``costs`` = (device fixed, device per row, host fixed, host per row) seconds and runs
    alone. For judging the calibration against a trace recorded without it (what-if: the costs are assumed, e.g.
    the steps-alone fit the trace reaches later)."""
    t0 = records[0]["t"]
    i = next((k for k, r in enumerate(records) if k and r["t"] - t0 >= at_s), len(records))
    t = records[i - 1]["t"]
    da, dc, ha, hc = costs
    cal = [{"op": "cal", "t": t, "on": True}]
    for rows in [streams] * 8 + list(range(streams - 1, 0, -1)):
        t += step_s
        cal.append({"op": "lm", "t": t, "rows": rows, "host_s": ha + hc * rows, "admitted": rows, "beside": False})
        cal.append({"op": "lmd", "t": t, "rows": rows, "device_s": da + dc * rows, "alone": True, "prefill": [0, 0.0]})
    cal.append({"op": "cal", "t": t, "on": False})
    later = [dict(r, t=max(r["t"], t)) for r in records[i:]]  # (the clock never runs backwards)
    return records[:i] + cal + later


def with_averaged_pace(records: list[dict], half_life_s: float) -> list[dict]:
    """``records`` with every ``cap`` record's ``pace`` averaged over time with ``half_life_s`` (:class:`PaceAverage`,
    as the engine reads its capacity since session 42; reset at each ``reset`` record, as the engine's). Raises
    ValueError for a trace whose init record says its paces were averaged already (``pace_half_life_s`` > 0)."""
    if records and records[0].get("pace_half_life_s"):
        raise ValueError(f"this trace's paces are averaged already (pace_half_life_s "
                         f"{records[0]['pace_half_life_s']} in its init record)")
    avg, out = PaceAverage(half_life_s), []
    for rec in records:
        if rec["op"] == "reset":
            avg.reset()
        elif rec["op"] == "cap":
            rec = {**rec, "pace": avg.update(rec["pace"], rec["t"])}
        out.append(rec)
    return out


def guard_caps(records: list[dict], settle_s: float, max_streams: int | None = None) -> list[int | None]:
    """The slack guard's cap at each ``cap`` record (in their order; None: no cap), a :class:`SlackGuard`
    (margin and recovery from the init record, else its defaults; ``settle_s``) fed the recorded close calls in
    order, its ceiling the recorded capacity (at most ``max_streams``, default the init record's); released at each
    ``reset`` record."""
    init = records[0]
    now = [init["t"]]
    guard = SlackGuard(margin_s=init.get("slack_margin_s", 0.05), recover_s=init.get("slack_recover_s", 0.5),
                       settle_s=settle_s, clock=lambda: now[0])
    top = max_streams if max_streams is not None else init.get("max_streams", 1 << 30)
    caps: list[int | None] = []
    for rec in records:
        now[0] = rec["t"]
        if rec["op"] == "slack":
            guard.observe(rec["s"], rec["a"])
        elif rec["op"] == "reset":
            guard.release()
        elif rec["op"] == "cap":
            caps.append(guard.limit(min(rec["cap"], top)))
    return caps


def _window(t: float, t0: float, bucket_s: float, start_s: float, end_s: float) -> int | None:
    """The index of the ``bucket_s``-second window that trace time ``t`` falls in (seconds from ``t0``), None
    outside ``[start_s, end_s)``."""
    rel = t - t0
    return int(rel // bucket_s) if start_s <= rel < end_s else None


def replay_table(records: list[dict], variants: list[dict], bucket_s: float = 0.5, start_s: float = 0.0,
                 end_s: float = math.inf, guard: list[int | None] | None = None) -> tuple[str, int]:
    """The markdown table described in the module doc, and the number of ``cap`` records where the replay with
    the recording's settings differs from the recording (0 for a complete trace). ``variants``: estimator
    keyword overrides, one column each after the recording's own; ``guard``: the slack guard's cap per ``cap``
    record (:func:`guard_caps`): then the recorded and each replayed column also min'd with it ("guarded")."""
    t0 = records[0]["t"]
    rows: dict[int, dict] = {}

    def row(t: float) -> dict | None:
        k = _window(t, t0, bucket_s, start_s, end_s)
        if k is None:
            return None
        n = len(variants) + 1
        return rows.setdefault(k, {"a": 0, "w": 0, "close": 0, "late": 0, "rec": [], "var": [[] for _ in range(n)],
                                   "grec": [], "gvar": [[] for _ in range(n)]})

    def guarded(j: int, cap: int) -> int:  # (j: the cap record's place among them)
        g = guard[j] if guard is not None else None
        return cap if g is None else min(cap, g)

    for rec in records:
        if rec["op"] == "slack" and (r := row(rec["t"])) is not None:
            r["late" if rec["s"] < 0 else "close"] += 1
    mismatches = 0
    for i, overrides in enumerate([{}] + variants):
        for j, (rec, cap) in enumerate(replay_admission_trace(records, **overrides)):
            if i == 0 and cap != rec["cap"]:
                mismatches += 1
            r = row(rec["t"])
            if r is None:
                continue
            r["var"][i].append(cap)
            r["gvar"][i].append(guarded(j, cap))
            if i == 0:
                r["rec"].append(rec["cap"])
                r["grec"].append(guarded(j, rec["cap"]))
                r["a"], r["w"] = max(r["a"], rec.get("a", 0)), max(r["w"], rec.get("w", 0))

    def fmt(caps: list[int]) -> str:
        return f"{min(caps)} / {sum(caps) / len(caps):.0f} / {max(caps)}" if caps else "–"

    names = ["replayed"] + [json.dumps(v, separators=(",", ":")) for v in variants]
    if guard is not None:
        names = [n for name in names for n in (name, f"{name} guarded")]
    wall = records[0].get("wall")

    def window(k: int) -> str:
        label = f"{k * bucket_s:.1f}-{(k + 1) * bucket_s:.1f}"
        return label if wall is None else label + time.strftime(" (%H:%M:%S)", time.localtime(wall + k * bucket_s))

    recorded = ["recorded cap"] + (["recorded guarded"] if guard is not None else [])
    lines = ["| window (s; local time) | active | waiting | close calls | late | "
             + " | ".join(f"{n} min / mean / max" for n in recorded + names) + " |",
             "|---|---:|---:|---:|---:|" + "---:|" * (len(recorded) + len(names))]
    for k in sorted(rows):
        r = rows[k]
        cols = [r["rec"]] + ([r["grec"]] if guard is not None else [])
        for i in range(len(r["var"])):
            cols += [r["var"][i]] + ([r["gvar"][i]] if guard is not None else [])
        lines.append(f"| {window(k)} | {r['a']} | {r['w']} | {r['close']} | {r['late']} | "
                     + " | ".join(fmt(c) for c in cols) + " |")
    return "\n".join(lines), mismatches


def terms_table(records: list[dict], overrides: dict, bucket_s: float = 0.5, start_s: float = 0.0,
                end_s: float = math.inf) -> str:
    """Per time window, the estimate with the fewest streams under ``overrides`` and what it is made of
    (``CapacityEstimator.terms`` at its LM pace): the pace, speed-up S and starting fraction f, then per resource
    its streams and the parts of U(b) as shares of the resource (LM fixed + per stream as every step ran; as the
    steps alone ran; the floor; token2wav fixed + per stream; the pace bound in streams). Says which term binds."""
    t0 = records[0]["t"]
    low: dict[int, tuple[int, dict, dict]] = {}

    def keep(rec: dict, m) -> None:
        k = _window(rec["t"], t0, bucket_s, start_s, end_s)
        if k is not None and (k not in low or m.last < low[k][0]):
            low[k] = (m.last, rec, m.terms(rec["pace"]))

    for _ in replay_admission_trace(records, on_cap=keep, **overrides):
        pass

    def part(d: dict, a: str, b: str) -> str:
        return f"{d[a]:.3f} + {d[b]:.4f}" if a in d and b in d else "–"

    lines = ["| window (s) | cap | active | pace | S | f | resource | streams | LM every step | LM alone | floor | "
             "token2wav | pace bound |", "|---|---:|---:|---:|---:|---:|---|---:|---|---|---:|---|---:|"]
    for k in sorted(low):
        cap, rec, t = low[k]
        for name in ("host", "device"):
            r = t.get(name)
            if r is None:
                continue
            lines.append(f"| {k * bucket_s:.1f} | {cap} | {rec.get('a', '–')} | {rec['pace']:.2f} | "
                         f"{t['speedup']:.2f} | {t['starting_fraction']:.2f} | {name} | {r['streams']:.1f} | "
                         f"{part(r, 'lm_fixed', 'lm_per_stream')} | {part(r, 'lm_alone_fixed', 'lm_alone_per_stream')} "
                         f"| {r.get('lm_floor', '–')} | {part(r, 't2w_fixed', 't2w_per_stream')} | "
                         f"{r.get('pace_streams', '–')} |")
    return "\n".join(lines)


def batch_tables(records: list[dict], start_s: float = 0.0, end_s: float = math.inf, gap_s: float = 0.1,
                 bin_s: float = 5.0, top: int = 10) -> str:
    """What the token2wav batches cost the scheduler thread, from the trace's ``t2w`` and ``lm`` records between
    ``start_s`` and ``end_s`` (seconds from the trace's start). Two markdown tables: the batches by the audio they
    emitted (``bin_s``-second bins): count, host seconds (the scheduler thread's launch and hand-out time, mean and
    most), device seconds (mean and most) and cost units (mean; traces priced per cost unit); then the scheduler's
    gaps: the stretches of at least ``gap_s`` seconds (and under 1 s: longer is idle) without an LM step while
    streams were active (the last ``cap`` record's ``a``; counted when a trace has none), their count and seconds,
    and the ``top`` longest with the token2wav batch of the most host time among those handed out in the gap and
    the first after it (a batch is recorded when handed out, its launch earlier): its host and device seconds and
    audio. A gap that one batch's host time fills is the LM waiting for that batch's launch: every stream's next
    tokens wait with it (docs/perf.md "Session 43": in ``--flow-stream-cache off`` the batches' host time grew with
    their flow input, up to 0.24 s, and the starting streams' second chunks came late behind one)."""
    t0 = records[0]["t"]
    bins: dict[int, list[tuple[float, float, float | None]]] = {}
    gaps: list[list] = []  # [start (s from t0), seconds, active, the batch with the most host time]
    waiting: list[list] = []  # the gaps whose next batch has not been handed out yet
    last_lm = active = None
    since_lm: list[dict] = []  # the batches handed out since the last LM step
    for r in records:
        rel = r["t"] - t0
        if r["op"] == "cap" and "a" in r:
            active = r["a"]
        elif r["op"] == "t2w":
            if start_s <= rel < end_s and r.get("device_s") is not None:
                bins.setdefault(int(r["audio_s"] // bin_s), []).append((r["host_s"], r["device_s"], r.get("cost")))
            # a batch's record comes when it is handed out: its launch may have filled the gap before it, so a
            # gap takes the batches handed out in it and the first after it
            since_lm.append(r)
            for g in waiting:
                if g[3] is None or r["host_s"] > g[3]["host_s"]:
                    g[3] = r
            waiting.clear()
        elif r["op"] == "lm":
            if (last_lm is not None and start_s <= last_lm - t0 < end_s and gap_s <= r["t"] - last_lm < 1.0
                    and (active is None or active > 0)):  # (a gap belongs to the window it starts in)
                gaps.append([last_lm - t0, r["t"] - last_lm, active,
                             max(since_lm, key=lambda b: b["host_s"], default=None)])
                waiting.append(gaps[-1])
            last_lm, since_lm = r["t"], []

    def ms(x: float | None) -> str:
        return "–" if x is None else f"{1e3 * x:.0f}"

    lines = ["| batch audio (s) | batches | host mean / most (ms) | device mean / most (ms) | cost units (mean) |",
             "|---|---:|---:|---:|---:|"]
    for k in sorted(bins):
        v = bins[k]
        host, dev = [h for h, _, _ in v], [d for _, d, _ in v]
        costs = [c for _, _, c in v if c is not None]
        lines.append(f"| {k * bin_s:g}-{(k + 1) * bin_s:g} | {len(v)} | {ms(sum(host) / len(v))} / {ms(max(host))} | "
                     f"{ms(sum(dev) / len(v))} / {ms(max(dev))} | "
                     f"{f'{sum(costs) / len(costs):.0f}' if costs else '–'} |")
    lines += ["", f"Scheduler gaps of {ms(gap_s)} ms or more without an LM step while streams were active: "
              f"{len(gaps)}, {sum(g[1] for g in gaps):.2f} s in all; the longest:", "",
              "| at (s) | gap (ms) | active | token2wav batch handed out in it or next: host / device (ms), audio (s) "
              "|",
              "|---:|---:|---:|---|"]
    for at, g, a, b in sorted(gaps, key=lambda x: -x[1])[:top]:
        what = "–" if b is None else f"{ms(b['host_s'])} / {ms(b.get('device_s'))}, {b['audio_s']:.1f}"
        lines.append(f"| {at:.2f} | {ms(g)} | {'–' if a is None else a} | {what} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--variant", type=_variant, action="append", default=[], metavar="JSON",
                    help="estimator settings to replay with, e.g. '{\"target\": 0.9}' (repeatable)")
    ap.add_argument("--bucket", type=float, default=0.5, metavar="SECONDS", help="table window (default 0.5)")
    ap.add_argument("--start", type=float, default=0.0, metavar="SECONDS", help="from this time (trace clock)")
    ap.add_argument("--end", type=float, default=math.inf, metavar="SECONDS", help="until this time")
    ap.add_argument("--calibrate-at", type=float, default=None, metavar="SECONDS",
                    help="what-if: insert a start-up calibration's LM steps (serve --admission-calibrate) this many "
                         "seconds into the trace (the recorded column then differs from the replayed one after it)")
    ap.add_argument("--calibrate-costs", default="0.0014,0.00005,0.0012,0.00006", metavar="DA,DC,HA,HC",
                    help="the calibration steps' seconds: device fixed, per row, host fixed, per row (default: an "
                         "H200's UNet LM alone, docs/perf.md \"Session 41\")")
    ap.add_argument("--pace-half-life", type=float, default=None, metavar="SECONDS",
                    help="average the recorded LM paces over time with this half-life first, as the engine does "
                         "since session 42 (traces recorded before it)")
    ap.add_argument("--guard", action="store_true",
                    help="add the slack guard's cap fed the recorded close calls (columns 'guarded')")
    ap.add_argument("--guard-settle", type=float, default=5.0, metavar="SECONDS",
                    help="--guard: the guard's settle time (default 5, the engine's; 0 = before session 42)")
    ap.add_argument("--terms", action="store_true",
                    help="also print, per window, the lowest estimate's parts (under the first --variant, else the "
                         "recording's settings)")
    ap.add_argument("--batches", action="store_true",
                    help="also print the token2wav batches' host and device seconds by audio size, and the scheduler's "
                         "gaps without an LM step (a batch's launch holding the LM)")
    ap.add_argument("--gap", type=float, default=0.1, metavar="SECONDS",
                    help="--batches: the shortest scheduler gap listed (default 0.1)")
    args = ap.parse_args(argv)
    if not args.bucket > 0:
        ap.error("--bucket must be > 0 seconds")
    if args.pace_half_life is not None and not 0 <= args.pace_half_life < math.inf:
        ap.error("--pace-half-life must be >= 0 seconds")
    if not 0 <= args.guard_settle < math.inf:
        ap.error("--guard-settle must be >= 0 seconds")
    if not 0 < args.gap < 1:
        ap.error("--gap must be between 0 and 1 seconds")
    try:
        records = list(read_admission_trace(args.trace))
        if not records:
            raise ValueError(f"{args.trace}: empty")
        if args.calibrate_at is not None:
            costs = tuple(float(x) for x in args.calibrate_costs.split(","))
            if len(costs) != 4:
                raise ValueError("--calibrate-costs takes four numbers")
            records = with_calibration(records, args.calibrate_at, costs)
        if args.pace_half_life is not None:
            records = with_averaged_pace(records, args.pace_half_life)
        guard = guard_caps(records, args.guard_settle) if args.guard else None
        table, mismatches = replay_table(records, args.variant, args.bucket, args.start, args.end, guard)
        terms = terms_table(records, args.variant[0] if args.variant else {}, args.bucket, args.start,
                            args.end) if args.terms else None
        batches = batch_tables(records, args.start, args.end, args.gap) if args.batches else None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"admission_replay: {exc}", file=sys.stderr)
        return 2
    print(table)
    print()
    if terms is not None:
        print(terms)
        print()
    if batches is not None:
        print(batches)
        print()
    if args.pace_half_life is not None:
        print(f"paces averaged with a {args.pace_half_life}-s half-life: the recorded column differs from the "
              f"replayed one at {mismatches} estimates")
    elif args.calibrate_at is not None:
        print(f"replay with the recording's settings and a calibration inserted at {args.calibrate_at} s: differs "
              f"from the recording at {mismatches} estimates (from the calibration on)")
    else:
        same = "equals the recording at every estimate" if not mismatches else \
            f"differs at {mismatches} estimates (trace incomplete?)"
        print("replay with the recording's settings: " + same)
    return 0


if __name__ == "__main__":
    sys.exit(main())
