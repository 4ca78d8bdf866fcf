"""``cosyserve bench``: latency and throughput of a TTS server under N concurrent clients.

For each concurrency level ``c`` of ``--concurrency`` (e.g. ``1,2,4,8,16``), ``c`` client
threads (each with its own connection) take requests from one shared list — the manifest's
items, cycled to ``--requests-per-level`` (default: every item ``--repeat`` times), and to at
least ``--min-requests-per-client`` (3) x ``c`` so that every level is a steady state rather
than one burst (a client sends at most its share, so each sends about as many) — and send them
one after the other (closed loop). A level with fewer requests per client is flagged *burst* in
the table. By default a level's clients all send their first request at once, a synchronised
burst of ``c`` arrivals that a server in steady state never sees; ``--ramp-s R`` starts client
``k`` at ``k x R / c`` instead (about one request's duration spreads the arrivals as a steady
state does; the tables then show the mean number of requests in flight, which is below ``c``
while the level ramps up and drains). Warm-up requests (``--warmup``) run first and are not counted. Protocols and what
counts as a chunk: :mod:`cosyserve.client.protocols`.

**Capacity mode** (``--capacity``): finds the largest number of concurrent clients that the
server keeps real time — 0 stalled streams, no failed request and first-chunk p99 within
``--p99-bound-ms`` (500) — each level a steady state of ``--min-requests-per-client`` requests
per client. Levels double (1, 2, 4, ... up to ``--max-streams``, or the ``--concurrency`` list
given) until one fails, then bisect between the last passing and the first failing level to
within ``--capacity-tolerance`` (10 % of the capacity, at least 1 stream). ``--overload F``
then runs one more level at F x the capacity: with admission control its admitted streams
must not stall (the others wait, or get 429 beyond the queue); the table shows stalls among the
requests that ran, refusals, and whether the server admitted queued requests in arrival order
(``cosyserve_admissions_out_of_order_total`` of ``/metrics``, or the in-process engine's count).

**Listeners** (``--playback``): each client plays its streams in real time and sends its next
request when the previous one's audio has finished playing (playback as for stalls below), as a
person or a voice agent listening to it would; ``c`` clients are then ``c`` concurrent
real-time streams. Without it a client sends its next request as soon as the previous response
is complete: a server that streams faster than real time then gets more than ``c`` streams'
worth of audio to make per second (run 2 of docs/perf.md "Session 31": 120 clients, 208x).

Per request (times from just before the request is sent, client clock):

* **first-chunk latency** — until the first audio arrives (offline: the whole waveform);
* **second-chunk latency** — from the first to the second chunk (as CosyVoice's
  ``client_grpc.py``); none with a single chunk;
* **total latency** — until the response is complete;
* **audio seconds** — returned samples / sample rate (24 kHz);
* **stalls** — playback starts when the first chunk arrives; a later chunk that arrives
  after everything before it has finished playing is a stall (playback waits for it and
  goes on). ``stalled`` = at least one stall.

Per level: avg/p50/p90/p95/p99 of the latencies (linear-interpolated percentiles, as
``numpy.percentile``), over successful requests; ``RTF = Σ total latency / Σ audio
seconds`` (compute seconds per audio second as one request sees it); ``throughput = Σ audio
seconds / wall seconds`` (× real time: audio the server produces per second with ``c``
clients); ``rtf_wall = wall / Σ audio`` (the RTF that ``client_grpc.py`` prints); requests
that stalled.

Output in ``--out``: ``report.json`` (configuration, machine, every level and every
request; both also written after every level, flagged partial until the run ends, so a run cut short keeps
the levels it finished), ``report.md`` (the Markdown tables also printed on stdout; stalled requests listed
with the chunk playback waited for), ``bench.png``
(latency percentiles vs concurrency; first-chunk latency CDF per level; needs matplotlib,
``pip install cosyserve[bench]``) and, with ``--save-audio``, one wav per request.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .. import __version__
from ..errors import CosyServeError
from .breakdown import EngineCounters, breakdown_markdown, level_breakdown
from .manifest import BenchItem, load_manifest, resolve_manifest
from .progress import Progress
from .protocols import (
    ClientError,
    GrpcStreamRunner,
    InProcessEngine,
    InProcessRunner,
    KServeOfflineRunner,
    OpenAIRunner,
    RequestSpec,
    Runner,
    Trace,
    check_combination,
    delete_openai_voices,
    parse_url,
    register_openai_voices,
    served_model_name,
)

if TYPE_CHECKING:  # the engine (torch) is imported only for --in-process
    from ..engine.core import EngineConfig

PCTS = (50, 90, 95, 99)

DEFINITIONS = {
    "first_chunk_s": "send -> first audio received (offline modes: the whole waveform)",
    "second_chunk_s": "first chunk received -> second chunk received (as client_grpc.py); null with one chunk",
    "total_s": "send -> response complete",
    "audio_s": "returned samples / sample_rate",
    "stall": "a chunk that arrives after all audio before it has finished playing, playback having started "
             "at the first chunk's arrival and waiting at each stall",
    "rtf": "sum of total_s / sum of audio_s over successful requests",
    "rtf_wall": "wall_s / sum of audio_s (the RTF printed by CosyVoice's client_grpc.py)",
    "throughput": "sum of audio_s / wall_s (x real time)",
    "in_flight_throughput": "concurrency / RTF of the requests that ran entirely while every client had a "
                            "request in flight (sent after the level's first completion, finished before its "
                            "last send): Little's law for a closed loop, audio per second with `concurrency` "
                            "requests in flight, without the level's ramp-up and drain; null with fewer than "
                            "`concurrency` such requests",
    "mean_in_flight": "sum of total_s over the level's requests / wall_s: the mean number of requests in flight "
                      "(Little's law; below the clients while they ramp up (--ramp-s) and drain)",
    "mean_playing": "sum over the level's streams of send -> end of playback (playback starting at the first "
                    "chunk, waiting at each stall) / wall_s: the mean number of streams being sent or played",
    "full_concurrency_s": "seconds of the level during which at least 95 % of its clients had a stream being sent "
                          "or played at once (send -> end of playback): how long the level held its clients' "
                          "streams together",
    "cycle_s": "how long a request kept its client busy: total_s, or with --playback until its audio had "
               "finished playing (the client then sent its next request)",
    "playback": "--playback: each client is a listener, it plays every stream in real time and sends its next "
                "request when the audio has finished playing; without it a client sends its next request as soon "
                "as the response is complete (it consumes audio as fast as the server sends it)",
    "ramp_s": "client k of c sent its first request k * ramp_s / c seconds after the level's start (0: all at once)",
    "started_at": "the level's start on the client's clock, Unix seconds (benchmarks/first_chunk_tail.py --report "
                  "splits a server log by it)",
    "percentiles": "numpy.percentile (linear interpolation) over successful requests",
}


@dataclass
class BenchOptions:
    """Everything ``cosyserve bench`` needs (see ``cosyserve bench --help``)."""

    url: str | None = None
    protocol: str = "grpc"
    mode: str = "streaming"
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    set: str | None = None
    limit: int | None = None
    requests_per_level: int | None = None
    repeat: int = 1
    warmup: int = 2
    seed: int = 0
    voice: str | None = None
    api_key: str | None = None
    model_name: str | None = None  # None: the server's (protocols.served_model_name)
    out: str = "bench_out"
    save_audio: bool = False
    timeout_s: float = 600.0
    progress: bool | None = None
    min_token_text_ratio: float | None = None
    max_token_text_ratio: float | None = None
    # in-process
    in_process: bool = False
    model_dir: str | None = None
    demo: bool = False
    device: str = "cpu"
    dtype: str = "float32"
    hift_dtype: str = "auto"
    token2wav_dir: str | None = None  # --in-process: Step-Audio2 DiT token2wav directory
    voices_dir: str | None = None
    #: the in-process engine's options (default: EngineConfig's); its max_queue is set to fit the levels
    engine: EngineConfig | None = None
    chunk_policy: str | None = None  # in-process: default upstream; a server: gRPC request parameter
    # server: its Prometheus page, scraped around each level for the stage breakdown
    # (default: URL/metrics for http/openai; none for grpc unless given)
    metrics_url: str | None = None
    #: every level sends at least this many requests per client (steady state, not a burst)
    min_requests_per_client: int = 3
    #: clients start over this many seconds (client k of c sends its first request k x ramp_s / c after the
    #: level's start) instead of all at once: steady-state arrivals rather than one synchronised burst
    ramp_s: float = 0.0
    #: streaming: each client plays its streams in real time and sends its next request when the audio has
    #: finished playing (a listener), not as soon as it has arrived; each client is then one real-time stream
    playback: bool = False
    # capacity mode (module doc)
    capacity: bool = False
    p99_bound_ms: float = 500.0
    max_streams: int = 256
    capacity_tolerance: float = 0.1
    overload: float = 0.0


STEADY_REQUESTS_PER_CLIENT = 3  #: fewer requests per client than this: the level is flagged "burst"
STALL_EVENTS_KEPT = 8  #: per request, the first this many stalls are kept in the report (chunk index, wait)
STALLED_LISTED = 10  #: per level, the report's stall table lists at most this many stalled requests


# ---------------------------------------------------------------------------- analysis


def playback(arrivals: list[tuple[float, int]], sample_rate: int) -> tuple[int, float, float | None]:
    """Play a chunk arrival sequence ``[(time, samples), ...]`` in real time (see the module
    docstring): ``(stalls, seconds waited, when playback ends)`` on the arrivals' clock (None
    without arrivals). Playback starts at the first chunk's arrival and waits at each stall."""
    events, end = _play(arrivals, sample_rate)
    return len(events), sum(w for _, w in events), end


def stall_events(arrivals: list[tuple[float, int]], sample_rate: int) -> list[tuple[int, float]]:
    """The stalls of :func:`playback`: ``[(chunk index, seconds playback waited for it), ...]`` (the
    first chunk is index 0 and never stalls)."""
    return _play(arrivals, sample_rate)[0]


def _play(arrivals: list[tuple[float, int]], sample_rate: int) -> tuple[list[tuple[int, float]], float | None]:
    if not arrivals:
        return [], None
    t0, n0 = arrivals[0]
    clock = t0 + n0 / sample_rate
    events = []
    for i, (t, n) in enumerate(arrivals[1:], 1):
        if t > clock:
            events.append((i, t - clock))
            clock = t
        clock += n / sample_rate
    return events, clock


def playback_stalls(arrivals: list[tuple[float, int]], sample_rate: int) -> tuple[int, float]:
    """``(stalls, seconds waited)`` of a chunk arrival sequence (:func:`playback`)."""
    return playback(arrivals, sample_rate)[:2]


def analyze(tr: Trace, t0: float | None = None, listen: bool = False) -> dict:
    """Per-request numbers of a :class:`Trace` (seconds); with ``t0`` (the level's start on the
    trace's clock) also when it was sent and finished, relative to ``t0``. ``cycle_s``: how long
    the request kept its client busy — until the response was complete, or with ``listen``
    (``bench --playback``) until its audio had also finished playing."""
    ok = tr.error is None and tr.t_end is not None and tr.samples > 0
    if tr.error is None and tr.t_end is not None and tr.samples == 0:
        tr.error = "no audio returned"
    first = tr.arrivals[0][0] - tr.t_send if tr.arrivals else None
    second = tr.arrivals[1][0] - tr.arrivals[0][0] if len(tr.arrivals) > 1 else None
    stalls, waited, end = playback(tr.arrivals, tr.sample_rate)
    total = (tr.t_end - tr.t_send) if tr.t_end is not None else None
    cycle = total if not listen or end is None or total is None else max(total, end - tr.t_send)
    return {
        "ok": ok, "error": tr.error,
        "first_chunk_s": first, "second_chunk_s": second,
        "total_s": total, "cycle_s": cycle,
        "chunks": len(tr.arrivals), "samples": tr.samples, "sample_rate": tr.sample_rate,
        "audio_s": tr.samples / tr.sample_rate,
        "stalls": stalls, "stall_s": waited, "stalled": stalls > 0,
        "stall_events": [[i, round(w, 6)] for i, w in stall_events(tr.arrivals, tr.sample_rate)[:STALL_EVENTS_KEPT]],
        "play_s": None if end is None else end - tr.t_send,
        "chunk_arrivals": [[round(t - tr.t_send, 6), n] for t, n in tr.arrivals],
        "sent_at_s": None if t0 is None else tr.t_send - t0,
        "done_at_s": None if t0 is None or tr.t_end is None else tr.t_end - t0,
        "free_at_s": None if t0 is None or cycle is None else tr.t_send + cycle - t0,
    }


def in_flight_throughput(concurrency: int, records: list[dict]) -> tuple[float | None, int]:
    """Audio seconds per second with ``concurrency`` requests in flight, from a closed-loop level
    (each client sends its next request when the previous one has kept it busy for its
    ``cycle_s``: until it finished, or with ``--playback`` until its audio finished playing) —
    Little's law: a closed system of ``c`` always-busy clients completes ``c / R`` requests per
    second for mean cycle ``R``, so audio per second = ``c * sum(audio) / sum(cycle)``, over the
    requests that ran entirely while every client was busy: sent after the level's first
    completion (not the synchronised first wave) and done before its last send (before the
    drain). Returns ``(throughput or None, requests used)``; None when fewer than ``concurrency``
    qualify (too few requests per client to leave a steady middle)."""
    def free(r):
        return r.get("free_at_s", r.get("done_at_s"))

    ok = [r for r in records if r["ok"] and r.get("sent_at_s") is not None and free(r) is not None]
    if not ok:
        return None, 0
    first_done = min(free(r) for r in ok)
    last_send = max(r["sent_at_s"] for r in records if r.get("sent_at_s") is not None)
    mid = [r for r in ok if r["sent_at_s"] >= first_done and free(r) <= last_send]
    audio, latency = sum(r["audio_s"] for r in mid), sum(r.get("cycle_s") or r["total_s"] for r in mid)
    if len(mid) < concurrency or audio <= 0 or latency <= 0:
        return None, len(mid)
    return concurrency * audio / latency, len(mid)


def full_concurrency_s(concurrency: int, records: list[dict], share: float = 0.95) -> float | None:
    """Seconds of a level during which at least ``share`` x ``concurrency`` streams were being sent
    or played at once (each request from its send until its playback ended, ``sent_at_s`` +
    ``play_s``): how long a level really held its clients' streams together, which its ramp-up and
    drain shorten. None without such timings."""
    spans = [(r["sent_at_s"], r["sent_at_s"] + r["play_s"]) for r in records
             if r.get("ok") and r.get("sent_at_s") is not None and r.get("play_s") is not None]
    if not spans:
        return None
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    need, level, since, total = share * concurrency, 0, None, 0.0
    for t, d in events:
        level += d
        if level >= need and since is None:
            since = t
        elif level < need and since is not None:
            total += t - since
            since = None
    return total


def stats(values: list[float]) -> dict | None:
    """avg/min/max and percentiles of ``values`` (``None`` when empty)."""
    v = [x for x in values if x is not None]
    if not v:
        return None
    a = np.asarray(v, dtype=np.float64)
    out = {"n": int(a.size), "avg": float(a.mean()), "min": float(a.min()), "max": float(a.max())}
    for p in PCTS:
        out[f"p{p}"] = float(np.percentile(a, p))
    return out


def summarize(concurrency: int, records: list[dict], wall_s: float) -> dict:
    """One level's numbers (see :data:`DEFINITIONS`)."""
    ok = [r for r in records if r["ok"]]
    audio = sum(r["audio_s"] for r in ok)
    compute = sum(r["total_s"] for r in ok)
    steady, n_steady = in_flight_throughput(concurrency, records)
    return {
        "concurrency": concurrency, "requests": len(records), "ok": len(ok), "failed": len(records) - len(ok),
        "requests_per_client": len(records) / concurrency,
        "burst": len(records) < STEADY_REQUESTS_PER_CLIENT * concurrency,
        "wall_s": wall_s, "audio_s": audio, "compute_s": compute,
        "rtf": compute / audio if audio else None,
        "mean_in_flight": sum(r["total_s"] for r in records if r["total_s"] is not None) / wall_s if wall_s > 0 else None,
        "mean_playing": sum(r["play_s"] for r in ok if r.get("play_s") is not None) / wall_s
        if wall_s > 0 and any(r.get("play_s") is not None for r in ok) else None,
        "full_concurrency_s": full_concurrency_s(concurrency, records),
        "rtf_wall": wall_s / audio if audio else None,
        "throughput": audio / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "in_flight_throughput": steady, "in_flight_requests": n_steady,
        "first_chunk_s": stats([r["first_chunk_s"] for r in ok]),
        "second_chunk_s": stats([r["second_chunk_s"] for r in ok]),
        "total_s": stats([r["total_s"] for r in ok]),
        "stalled": sum(1 for r in ok if r["stalled"]),
        "stall_s": sum(r["stall_s"] for r in ok),
        "errors": sorted({r["error"] for r in records if r["error"]})[:5],
    }


def machine_info() -> dict:
    """The client machine: CPU model (``/proc/cpuinfo``), cores, OS, Python."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "os": platform.platform(), "python": platform.python_version()}


# ---------------------------------------------------------------------------- presentation


def _ms(x: float | None) -> str:
    if x is None:
        return "–"
    v = x * 1000
    return f"{v:.1f}" if v < 10 else f"{v:.0f}"


def _num(x: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if x is None else fmt.format(x)


def ratio_text(report: dict) -> str:
    r = report.get("token_text_ratio") or {}
    lo, hi = r.get("min"), r.get("max")
    if lo is None and hi is None:
        return "token/text ratio: not reported by the server"
    return f"token/text ratio {lo:g}–{hi:g} ({r.get('source', '')})"


def _inflight(lv: dict) -> str:
    v = lv.get("in_flight_throughput")
    return f"– ({lv.get('in_flight_requests', 0)})" if v is None else f"{v:.2f}× ({lv['in_flight_requests']})"


def markdown(report: dict) -> str:
    """The Markdown summary of a report (also written to ``report.md``)."""
    c = report["config"]
    stream = c["mode"] == "streaming"
    target = "in-process engine" if c["in_process"] else c["url"]
    what = c["mode"] if c["in_process"] else f"{c['protocol']} {c['mode']}"
    lines = [f"### cosyserve bench — {what} — {target}", "",
             *(["**Partial report**: written after the last level below; the run had not finished (it goes on, "
                "or it was cut short).", ""] if report.get("partial") else []),
             f"{report['set']['items']} items from `{report['set']['name']}`, "
             f"{c['requests_per_level']} requests per level (at least {c.get('min_requests_per_client', 1)} per "
             f"client), {c['warmup']} warm-up, seed {c['seed']}; "
             + (f"clients started over {c['ramp_s']:g} s (not all at once); " if c.get("ramp_s") else "")
             + ("each client plays its streams in real time and sends the next request when the audio has "
                "finished playing (--playback); " if c.get("playback") else "")
             + f"{ratio_text(report)}; client: {report['machine']['cpu']}, {report['machine']['cores']} cores", ""]
    if stream:
        lines += ["| clients | ok/sent | per client | first chunk avg | p50 | p90 | p95 | p99 | 1st→2nd chunk p50 | "
                  "total p50 | total p99 | RTF | throughput | stalled |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    else:
        lines += ["| clients | ok/sent | per client | latency avg | p50 | p90 | p95 | p99 | RTF | throughput | "
                  "in flight (n) |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lv in report["levels"]:
        pc = _per_client(lv)
        f, s, t = lv["first_chunk_s"] or {}, lv["second_chunk_s"] or {}, lv["total_s"] or {}
        thr = "–" if lv["throughput"] is None else f"{lv['throughput']:.2f}×"
        if stream:
            lines.append(f"| {lv['concurrency']} | {lv['ok']}/{lv['requests']} | {pc} | {_ms(f.get('avg'))} | "
                         f"{_ms(f.get('p50'))} | {_ms(f.get('p90'))} | {_ms(f.get('p95'))} | {_ms(f.get('p99'))} | "
                         f"{_ms(s.get('p50'))} | {_ms(t.get('p50'))} | {_ms(t.get('p99'))} | {_num(lv['rtf'])} | "
                         f"{thr} | {lv['stalled']} |")
        else:
            lines.append(f"| {lv['concurrency']} | {lv['ok']}/{lv['requests']} | {pc} | {_ms(t.get('avg'))} | "
                         f"{_ms(t.get('p50'))} | {_ms(t.get('p90'))} | {_ms(t.get('p95'))} | {_ms(t.get('p99'))} | "
                         f"{_num(lv['rtf'])} | {thr} | {_inflight(lv)} |")
    lines += ["", "Latencies in ms. Per client: requests each client sent back to back (burst: fewer than "
              f"{STEADY_REQUESTS_PER_CLIENT}, not a steady state). RTF = Σ request latency / Σ audio seconds; "
              "throughput = Σ audio seconds / wall seconds (× real time)" + ("; stalled = requests whose playback, started at the first chunk, "
                                              "ran dry before a later chunk arrived." if stream else
                                              "; in flight = clients / RTF of the n requests that ran while every "
                                              "client had one in flight (no ramp-up or drain; – when too few).")]
    if report.get("capacity"):
        lines += capacity_markdown(report)
    lines += stalls_markdown(report)
    lines += breakdown_markdown(report["levels"])
    errs = sorted({e for lv in report["levels"] for e in lv["errors"]})
    if errs:
        lines += ["", "Errors: " + "; ".join(errs[:5])]
    return "\n".join(lines) + "\n"


def stalls_markdown(report: dict) -> list[str]:
    """Where the stalls were: per level with any, its first :data:`STALLED_LISTED` stalled requests in send order
    (when sent into the level, the first chunk's latency, the first stall's chunk, when it arrived and how long
    playback ran dry, all stalls' count and total wait); no lines without stalls."""
    rows = []
    for k, lv in enumerate(report["levels"]):
        bad = sorted((r for r in report["requests"] if r.get("level") == k and r.get("stalled")),
                     key=lambda r: (r.get("sent_at_s") is None, r.get("sent_at_s") or 0.0))
        for r in bad[:STALLED_LISTED]:
            ev = r.get("stall_events") or []
            arr = r.get("chunk_arrivals") or []
            sent = "–" if r.get("sent_at_s") is None else f"{r['sent_at_s']:.1f} s"
            if ev and ev[0][0] < len(arr):
                i, dry = ev[0]
                first = f"{i} of {r['chunks']} at {arr[i][0] * 1e3:.0f} ms, dry {dry * 1e3:.0f} ms"
            else:
                first = "–"
            rows.append(f"| {lv.get('role', 'level')} | {lv['concurrency']} | {r['index']} | {sent} | "
                        f"{_ms(r.get('first_chunk_s'))} | {first} | {r['stalls']} ({r['stall_s'] * 1e3:.0f} ms) |")
        if len(bad) > STALLED_LISTED:
            rows.append(f"| {lv.get('role', 'level')} | {lv['concurrency']} | … {len(bad) - STALLED_LISTED} more | "
                        "| | | |")
    if not rows:
        return []
    return ["", f"Stalled requests (per level the first {STALLED_LISTED} in send order; sent: seconds after the level "
                "started; first stall: the chunk playback waited for, when it arrived after the request was sent, and "
                "how long playback ran dry):", "",
            "| level | clients | request | sent | first chunk | first stall | stalls (total dry) |",
            "|---|---:|---:|---:|---:|---|---:|", *rows]


def _per_client(lv: dict) -> str:
    n = lv.get("requests_per_client", lv["requests"] / lv["concurrency"])
    txt = f"{n:.0f}" if float(n).is_integer() else f"{n:.1f}"
    return txt + (" (burst)" if lv.get("burst") else "")


def capacity_markdown(report: dict) -> list[str]:
    """The capacity search's table (one row per level, in the order run) and its verdict."""
    cap = report["capacity"]
    stream = report["config"]["mode"] == "streaming"
    playing = bool(report["config"].get("playback"))
    lines = ["", f"Capacity search — pass: 0 failed, 0 stalled, first-chunk p99 ≤ {cap['p99_bound_ms']:g} ms, "
                 f"≥ {cap['min_requests_per_client']} requests per client"
                 + (" (clients listen: each plays its stream in real time; mean in flight: at the server "
                    "(being sent or played; seconds with at least 95 % of the clients' streams at once))"
                    if playing else "") + "; queue held by: the seconds the server's queue head waited, per "
                 "admission bound (capacity: the model's estimate, starting: streams in their first chunks, slack, "
                 "memory, fixed, max_active):", "",
             "| level | clients | mean in flight | requests | first chunk p50 | p90 | p99 | stalled/sent | failed | "
             "throughput | queue wait | queue held by | admitted out of order | capacity gauge | result |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for lv in report["levels"]:
        f = lv["first_chunk_s"] or {}
        b = lv.get("breakdown") or {}
        q = (b.get("phases") or {}).get("queue")
        adm = lv.get("admission") or {}
        ooo = "–" if adm.get("out_of_order") is None else f"{adm['out_of_order']:.0f}/{adm.get('admitted', 0):.0f}"
        gauge = adm.get("capacity_streams")
        gauge = "–" if gauge is None or gauge != gauge else f"{gauge:.0f}"
        thr = "–" if lv["throughput"] is None else f"{lv['throughput']:.2f}×"
        mif, mp = lv.get("mean_in_flight"), lv.get("mean_playing")
        full = lv.get("full_concurrency_s")
        mif = "–" if mif is None else f"{mif:.1f}" + (
            f" ({mp:.1f}; {full:.0f} s all)" if playing and mp is not None and full is not None else "")
        lines.append(f"| {lv.get('role', 'probe')} | {lv['concurrency']} | {mif} | "
                     f"{lv['requests']} | {_ms(f.get('p50'))} | "
                     f"{_ms(f.get('p90'))} | {_ms(f.get('p99'))} | {lv['stalled'] if stream else '–'}/{lv['ok']} | "
                     f"{lv['failed']} | {thr} | {'–' if q is None else f'{q:.0f} ms'} | "
                     f"{_held_text(adm.get('held_s'))} | {ooo} | {gauge} | "
                     f"{lv.get('verdict', '')} |")
    if cap["streams"] is None:  # a partial report (run_bench writes one after every level)
        return lines + ["", "Capacity: the search has not finished (a partial report, written after its last level "
                            "above)."]
    top = "" if cap["first_failing"] is not None else f" (every level up to {cap['max_probed']} passed)"
    lines += ["", f"**Capacity: {cap['streams']} concurrent streams**{top}; first failing level: "
                  f"{cap['first_failing'] if cap['first_failing'] is not None else '–'}."]
    ov = cap.get("overload")
    if ov:
        lines += [f"Overload at {ov['factor']:g}× ({ov['clients']} clients): {ov['stalled']} of {ov['ok']} streams "
                  f"that ran stalled, {ov['failed']} refused or failed; queued requests admitted in arrival order: "
                  f"{'unknown' if ov['in_order'] is None else ('yes' if ov['in_order'] else 'NO')}."]
    return lines


def plot(report: dict, path: Path) -> Path | None:
    """``bench.png``: latency percentiles vs concurrency, and the first-chunk latency CDF.
    Returns ``None`` (with a note on stderr) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: no plot (matplotlib is not installed: pip install 'cosyserve[bench]')", file=sys.stderr)
        return None
    c = report["config"]
    stream = c["mode"] == "streaming"
    key, name = ("first_chunk_s", "first-chunk latency") if stream else ("total_s", "latency (whole waveform)")
    levels = [lv for lv in report["levels"] if lv[key]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.6))
    xs = [lv["concurrency"] for lv in levels]
    for p, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
        a1.plot(xs, [lv[key][p] * 1000 for lv in levels], style, label=f"{name} {p}")
    if stream:
        a1.plot(xs, [lv["total_s"]["p50"] * 1000 for lv in levels if lv["total_s"]], "d-", color="grey",
                alpha=0.7, label="total latency p50")
    a1.set_xscale("log", base=2)
    a1.set_xticks(xs, [str(x) for x in xs])
    a1.set_xlabel("concurrent clients")
    a1.set_ylabel("ms")
    a1.set_title("latency vs concurrency")
    a1.grid(True, alpha=0.3)
    a1.legend(fontsize=8)
    by_level: dict[int, list[float]] = {}
    for r in report["requests"]:
        if r["ok"] and r[key] is not None:
            by_level.setdefault(r["concurrency"], []).append(r[key] * 1000)
    for lvl in sorted(by_level):
        v = np.sort(np.asarray(by_level[lvl]))
        a2.step(np.concatenate([[v[0]], v]), np.arange(0, v.size + 1) / v.size, where="post",
                label=f"{lvl} client{'s' if lvl > 1 else ''}")
    a2.set_xlabel(f"{name} (ms)")
    a2.set_ylabel("fraction of requests")
    a2.set_ylim(0, 1.02)
    a2.set_title(f"{name} CDF")
    a2.grid(True, alpha=0.3)
    a2.legend(fontsize=8)
    what = f"in-process {c['mode']}" if c["in_process"] else f"{c['protocol']} {c['mode']} — {c['url']}"
    fig.suptitle(f"cosyserve bench — {what} — {report['set']['name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- running


def _server_ratio(opts: BenchOptions, addr: str, scheme: str) -> dict:
    """The server's token/text ratio and chunk policy from its KServe model config
    (``parameters``, a cosyserve extension); ``{}`` when unavailable."""
    params = {}
    try:
        if opts.protocol == "grpc":
            import tritonclient.grpc as tg

            cl = tg.InferenceServerClient(addr)
            cfg = cl.get_model_config(opts.model_name, headers=_headers(opts), as_json=True)
            params = {k: v.get("string_value") for k, v in (cfg.get("config", {}).get("parameters") or {}).items()}
            cl.close()
        else:
            import httpx

            r = httpx.get(f"{scheme}://{addr}/v2/models/{opts.model_name}/config", headers=_headers(opts), timeout=10)
            if r.status_code == 200:
                params = {k: (v or {}).get("string_value") for k, v in (r.json().get("parameters") or {}).items()}
    except Exception:  # noqa: BLE001 - informational only
        return {}
    return params


def _headers(opts: BenchOptions) -> dict:
    return {"authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}


class _Setup:
    """Runner factory + per-item request data for one benchmark run."""

    def __init__(self, opts: BenchOptions, items: list[BenchItem]):
        self.opts, self.items = opts, items
        self.created_voices: list[str] = []
        self.shared: InProcessEngine | None = None
        self.server_params: dict = {}
        self.prompts = {it.id: it.prompt_16k() for it in items} if not opts.voice else {}
        self.voice_of: dict[str, str] = {}
        self.metrics_url: str | None = None
        if opts.in_process:
            self._start_in_process()
            return
        if not opts.url:
            raise ClientError("--url is required (or --in-process)")
        check_combination(opts.protocol, opts.mode)
        if opts.chunk_policy and not (opts.protocol == "grpc" and opts.mode == "streaming"):
            raise ClientError("--chunk-policy for a server is sent as a KServe gRPC streaming request parameter: "
                              "use --protocol grpc --mode streaming (or start the server with --chunk-policy)")
        self.scheme, self.addr = parse_url(opts.url, opts.protocol)
        self.base = f"{self.scheme}://{self.addr}"
        if not opts.model_name:  # the server's own (cosyvoice2, cosyvoice3 or its --model-name)
            opts.model_name = served_model_name(opts.protocol, self.scheme, self.addr, opts.api_key)
        self.server_params = _server_ratio(opts, self.addr, self.scheme)
        self.metrics_url = opts.metrics_url or (f"{self.base}/metrics" if self.scheme in ("http", "https") else None)
        if opts.protocol == "openai" and not opts.voice:
            prompts = {it.id: (it.prompt_wav.read_bytes(), it.prompt_text) for it in items}
            self.voice_of, self.created_voices = register_openai_voices(self.base, prompts, opts.api_key)

    def _start_in_process(self) -> None:
        from ..engine.chunking import ChunkPolicy
        from ..engine.core import EngineConfig
        from ..engine.pipeline import DTYPES, Synthesizer
        from ..engine.request import SynthesisParams
        from ..frontend.voice import VoiceStore

        o = self.opts
        if o.mode not in ("streaming", "offline"):
            raise ClientError(f"unknown mode {o.mode!r}")
        builtin = {}
        if o.demo:
            from ..models.demo import write_demo_model

            cache = Path(os.environ.get("COSYSERVE_CACHE_DIR") or Path.home() / ".cache" / "cosyserve")
            model_dir = write_demo_model(cache / "demo-model")
        elif o.model_dir:
            model_dir = o.model_dir
        else:
            raise ClientError("--in-process needs --model-dir DIR or --demo")
        synth = Synthesizer(model_dir, device=o.device, dtype=DTYPES[o.dtype], hift_dtype=o.hift_dtype,
                            token2wav_dir=o.token2wav_dir)
        synth.frontend.warmup()
        if synth.is_demo and o.voice == "default":  # demo / random-weight models: the shipped prompt
            from ..models.demo import shipped_prompt

            builtin["default"] = synth.make_voice("default", *shipped_prompt())
        lo = 2.0 if o.min_token_text_ratio is None else o.min_token_text_ratio
        hi = 20.0 if o.max_token_text_ratio is None else o.max_token_text_ratio
        try:
            policy = ChunkPolicy.parse(o.chunk_policy or "upstream")
        except ValueError as exc:
            raise ClientError(str(exc)) from None

        def params(seed, stream):
            return SynthesisParams(seed=seed, stream=stream, chunk_policy=policy, min_token_text_ratio=lo,
                                   max_token_text_ratio=hi, timeout_s=o.timeout_s)

        self.server_params = {"min_token_text_ratio": str(lo), "max_token_text_ratio": str(hi),
                              "chunk_policy": o.chunk_policy or "upstream"}
        voices = VoiceStore(o.voices_dir) if (o.voice and o.voices_dir) else None
        engine = replace(o.engine or EngineConfig(), max_queue=max(64, max_clients(o) * 2))
        self.shared = InProcessEngine(synth, engine, params, voices, builtin)
        from ..engine.gc_pauses import freeze_startup_heap

        freeze_startup_heap()  # as the server does after its warm-up

    def engine_counters(self) -> EngineCounters | None:
        """A snapshot of the engine's stage/phase counters (None when unavailable)."""
        if self.shared is not None:
            return self.shared.counters.snapshot()
        if not self.metrics_url:
            return None
        try:
            import httpx

            r = httpx.get(self.metrics_url, headers=_headers(self.opts), timeout=10)
            r.raise_for_status()
            return EngineCounters.from_metrics(r.text)
        except Exception:  # noqa: BLE001 - informational (e.g. a Triton server has other metrics)
            return None

    def admission_counters(self) -> dict | None:
        """The engine's admission numbers now: ``admitted`` and ``out_of_order`` (cumulative),
        ``capacity_streams`` (the gauge), ``held_s`` (cumulative seconds the queue's head waited, per
        admission bound); None when unavailable (no metrics URL, another server)."""
        if self.shared is not None:
            core = self.shared.engine.core
            return {"admitted": core.stats.admitted, "out_of_order": core.stats.admitted_out_of_order,
                    "capacity_streams": core.capacity_streams, "held_s": dict(core.stats.admission_held_s)}
        if not self.metrics_url:
            return None
        try:
            import httpx
            from prometheus_client.parser import text_string_to_metric_families

            r = httpx.get(self.metrics_url, headers=_headers(self.opts), timeout=10)
            r.raise_for_status()
            samples = [smp for fam in text_string_to_metric_families(r.text) for smp in fam.samples]
        except Exception:  # noqa: BLE001 - informational
            return None
        vals = {smp.name: smp.value for smp in samples if not smp.labels}
        if "cosyserve_admissions_total" not in vals:
            return None
        held = {smp.labels["bound"]: smp.value for smp in samples
                if smp.name == "cosyserve_admission_held_seconds_total" and "bound" in smp.labels}
        return {"admitted": vals["cosyserve_admissions_total"],
                "out_of_order": vals.get("cosyserve_admissions_out_of_order_total", 0.0),
                "capacity_streams": vals.get("cosyserve_capacity_streams"), "held_s": held}

    def runner(self, keep_audio: bool) -> Runner:
        o = self.opts
        if self.shared is not None:
            r: Runner = InProcessRunner(self.shared, o.mode == "streaming", o.timeout_s)
        elif o.protocol == "grpc" and o.mode == "streaming":
            r = GrpcStreamRunner(self.addr, o.model_name, o.api_key, o.timeout_s)
        elif o.protocol in ("grpc", "http"):
            r = KServeOfflineRunner(o.protocol, self.addr, o.model_name, o.api_key, o.timeout_s,
                                    ssl=self.scheme == "https")
        else:
            r = OpenAIRunner(self.base, o.mode == "streaming", o.model_name, o.api_key, o.timeout_s)
        r.keep_audio = keep_audio
        return r

    def spec(self, item: BenchItem, seed: int) -> RequestSpec:
        voice = self.opts.voice or self.voice_of.get(item.id)
        return RequestSpec(request_id=uuid.uuid4().hex, text=item.target_text, seed=seed, voice=voice,
                           prompt_16k=None if voice else self.prompts[item.id],
                           prompt_text=None if voice else item.prompt_text, item_id=item.id,
                           chunk_policy=None if self.opts.in_process else self.opts.chunk_policy)

    def close(self) -> None:
        if self.created_voices:
            delete_openai_voices(self.base, self.created_voices, self.opts.api_key)
        if self.shared is not None:
            self.shared.close()


def _run_level(setup: _Setup, work: list[tuple[int, BenchItem, int]], concurrency: int, keep_audio: bool,
               progress: Progress | None, ramp_s: float = 0.0,
               listen: bool = False) -> tuple[list[tuple[int, BenchItem, int, Trace]], float, float]:
    """Run ``work`` with ``concurrency`` client threads; returns the traces (in work order),
    the wall time from the level's start to the last completion (seconds) and the start time
    (``time.perf_counter``, the traces' clock). Each client sends at most its share,
    ``ceil(len(work) / concurrency)`` requests, back to back; client ``k`` sends its first one
    ``k x ramp_s / concurrency`` seconds after the start (``ramp_s`` 0: all at once). With
    ``listen`` (``--playback``) a client plays each stream in real time (:func:`playback`) and
    sends its next request when the audio has finished playing, not when it has arrived.

    Each thread opens its own connection (runner) before the clock starts and closes it
    after (tritonclient.http's gevent client must stay on the thread that made it).
    """
    lock = threading.Lock()
    pending = list(reversed(work))
    done: list[tuple[int, BenchItem, int, Trace]] = []
    start: list[float] = []
    # the clock starts when every connection is open, before any thread may send
    ready = threading.Barrier(concurrency + 1, action=lambda: start.append(time.perf_counter()))
    failures: list[BaseException] = []
    share = -(-len(work) // concurrency)

    def worker(k: int) -> None:
        try:
            runner = setup.runner(keep_audio)
        except BaseException as exc:  # noqa: BLE001 - reported after the barrier
            failures.append(exc)
            ready.wait()
            return
        ready.wait()
        try:
            delay = start[0] + k * ramp_s / concurrency - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            for _ in range(share):
                with lock:
                    if not pending:
                        return
                    idx, item, seed = pending.pop()
                tr = runner.run(setup.spec(item, seed))
                with lock:
                    done.append((idx, item, seed, tr))
                if progress is not None:
                    progress.advance(tr.error is None)
                end = playback(tr.arrivals, tr.sample_rate)[2] if listen and tr.error is None else None
                if end is not None and end > time.perf_counter():  # listen until the audio has played
                    time.sleep(end - time.perf_counter())
        finally:
            runner.close()

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(concurrency)]
    for t in threads:
        t.start()
    ready.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start[0]
    if failures:
        raise ClientError(f"cannot connect: {failures[0]}")
    done.sort(key=lambda x: x[0])
    return done, wall, start[0]


def max_clients(opts: BenchOptions) -> int:
    """The most concurrent clients a run can use (levels, capacity search, overload)."""
    top = max(opts.concurrency) if opts.concurrency else 1
    if opts.capacity:
        top = max(top, opts.max_streams)
        if opts.overload > 0:
            top = max(top, int(math.ceil(opts.overload * top)))
    return top


def _level(setup: _Setup, opts: BenchOptions, items: list[BenchItem], c: int, n_req: int, out: Path) -> tuple:
    """Run one level of ``c`` clients (at least ``min_requests_per_client`` requests each);
    returns its summary (with the stage breakdown and admission counters) and its records."""
    n = max(n_req, c * opts.min_requests_per_client)
    work = [(i, items[i % len(items)], opts.seed + i % len(items)) for i in range(n)]
    prog = Progress(len(work), f"{c} client{'s' if c > 1 else ''}", opts.progress)
    before, adm0 = setup.engine_counters(), setup.admission_counters()
    res, wall, t0 = _run_level(setup, work, c, opts.save_audio, prog, opts.ramp_s, opts.playback)
    started_at = time.time() - (time.perf_counter() - t0)  # the level's start, epoch seconds
    after, adm1 = setup.engine_counters(), setup.admission_counters()
    prog.close()
    recs = []
    for idx, item, seed, tr in res:
        r = {"concurrency": c, "index": idx, "item": item.id, "language": item.language, "seed": seed,
             **analyze(tr, t0, opts.playback)}
        if opts.save_audio and tr.audio:
            import soundfile as sf

            p = out / "audio" / f"c{c}_{idx:04d}_{item.id}.wav"
            sf.write(str(p), tr.waveform(), tr.sample_rate, subtype="FLOAT")
            r["audio_file"] = str(p.relative_to(out))
        recs.append(r)
    lv = summarize(c, recs, wall)
    lv["ramp_s"] = opts.ramp_s
    lv["started_at"] = round(started_at, 3)
    lv["breakdown"] = level_breakdown(before, after)
    lv["admission"] = None if adm0 is None or adm1 is None else {
        "admitted": adm1["admitted"] - adm0["admitted"], "out_of_order": adm1["out_of_order"] - adm0["out_of_order"],
        "capacity_streams": adm1["capacity_streams"], "held_s": _held_delta(adm0.get("held_s"), adm1.get("held_s"))}
    return lv, recs


def _held_delta(before: dict | None, after: dict | None) -> dict | None:
    """Seconds the queue's head waited during a level, per admission bound (those above 0), from two
    cumulative readings (:meth:`_Setup.admission_counters`); None where the server does not report them."""
    if before is None or after is None:
        return None
    return {k: round(v - before.get(k, 0.0), 3) for k, v in sorted(after.items()) if v - before.get(k, 0.0) > 0}


def _held_text(held: dict | None) -> str:
    """``capacity 3.1 s, starting 0.4 s`` (longest first), ``0`` without waits, ``–`` unreported."""
    if held is None:
        return "–"
    if not held:
        return "0"
    return ", ".join(f"{k} {v:.1f} s" for k, v in sorted(held.items(), key=lambda kv: -kv[1]))


def level_passes(lv: dict, p99_bound_ms: float) -> tuple[bool, str]:
    """Capacity criterion of a level: no failed request, no stalled stream, first-chunk p99
    within the bound. Returns ``(passed, why not / "pass")``."""
    if lv["failed"]:
        return False, f"{lv['failed']} failed"
    if lv["stalled"]:
        return False, f"{lv['stalled']} stalled"
    p99 = (lv["first_chunk_s"] or {}).get("p99")
    if p99 is None or p99 * 1000 > p99_bound_ms:
        return False, "p99 " + ("–" if p99 is None else f"{p99 * 1000:.0f} ms") + f" > {p99_bound_ms:g} ms"
    return True, "pass"


def _capacity_search(run, opts: BenchOptions, ladder: list[int]) -> dict:
    """Find the largest passing level: ``run(c)`` measures a level and returns its summary.
    The ``ladder`` (ascending) is probed until a level fails, then the gap between the last
    passing and the first failing level is bisected down to ``capacity_tolerance`` x the
    capacity (at least 1)."""
    lo, hi = 0, None
    for c in ladder:
        lv = run(c, "probe")
        if not lv["pass"]:
            hi = c
            break
        lo = c
    if hi is not None:
        while hi - lo > max(1, int(lo * opts.capacity_tolerance)):
            mid = (lo + hi) // 2
            lv = run(mid, "bisect")
            if lv["pass"]:
                lo = mid
            else:
                hi = mid
    return {"streams": lo, "first_failing": hi, "max_probed": ladder[-1] if ladder else 0,
            "p99_bound_ms": opts.p99_bound_ms, "min_requests_per_client": opts.min_requests_per_client}


def _write_report(out: Path, report: dict) -> str:
    """Write ``report.json`` and ``report.md`` into ``out``; returns the Markdown."""
    (out / "report.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    md = markdown(report)
    (out / "report.md").write_text(md, encoding="utf-8")
    return md


def _report(opts: BenchOptions, setup: "_Setup", manifest: Path, items: list, n_req: int, levels: list[dict],
            records: list[dict], capacity: dict | None, partial: bool = False) -> dict:
    """The report dict of a run (:func:`run_bench`); ``partial``: written after a level of a run that goes on (the
    capacity search's verdict, the overload and the plot come with the final report)."""
    sp = setup.server_params

    def _f(k):
        try:
            return float(sp[k])
        except (KeyError, TypeError, ValueError):
            return None

    ratio = {"min": _f("min_token_text_ratio"), "max": _f("max_token_text_ratio"),
             "source": "in-process setting" if opts.in_process else "reported by the server"}
    if ratio["min"] is None and not opts.in_process and opts.min_token_text_ratio is not None:
        ratio = {"min": opts.min_token_text_ratio, "max": opts.max_token_text_ratio,
                 "source": "declared with --min/--max-token-text-ratio (the server did not report it)"}
    notes = []
    if not opts.in_process and opts.min_token_text_ratio is not None and ratio["source"] == "reported by the server" \
            and (ratio["min"], ratio["max"]) != (opts.min_token_text_ratio, opts.max_token_text_ratio):
        notes.append(f"--min/--max-token-text-ratio {opts.min_token_text_ratio}/{opts.max_token_text_ratio} differ "
                     f"from the server's {ratio['min']}/{ratio['max']}: the server's settings were in effect")
    cfg = asdict(opts)
    cfg.update(requests_per_level=n_req, api_key="***" if opts.api_key else None)
    report = {
        "tool": "cosyserve bench", "version": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": cfg, "machine": machine_info(),
        "set": {"name": manifest.parent.name if manifest.name == "manifest.jsonl" else manifest.name,
                "manifest": str(manifest), "items": len(items)},
        "server": sp, "token_text_ratio": ratio, "notes": notes, "definitions": DEFINITIONS,
        "levels": levels, "requests": records,
    }
    if capacity is not None:
        report["capacity"] = capacity
    elif partial and opts.capacity:
        report["capacity"] = {"streams": None, "first_failing": None, "max_probed": max(opts.concurrency),
                              "p99_bound_ms": opts.p99_bound_ms,
                              "min_requests_per_client": opts.min_requests_per_client}
    if partial:
        report["partial"] = True
    return report


def run_bench(opts: BenchOptions, echo=print) -> dict:
    """Run the benchmark; write the outputs into ``opts.out``; return the report dict.

    Raises :class:`~cosyserve.errors.CosyServeError` subclasses for bad options, a missing
    manifest, or a server that cannot be reached at all.
    """
    if opts.capacity and not opts.concurrency:
        opts = replace(opts, concurrency=[c for c in (2 ** k for k in range(20)) if c < opts.max_streams]
                       + [opts.max_streams])
    if not opts.concurrency or any(c < 1 for c in opts.concurrency):
        raise ClientError("--concurrency must list positive integers, e.g. 1,2,4,8,16")
    if opts.repeat < 1 or (opts.requests_per_level is not None and opts.requests_per_level < 1) or opts.warmup < 0:
        raise ClientError("--repeat and --requests-per-level must be >= 1, --warmup >= 0")
    if opts.min_requests_per_client < 1:
        raise ClientError("--min-requests-per-client must be >= 1")
    if not opts.ramp_s >= 0:
        raise ClientError("--ramp-s must be >= 0 seconds")
    if opts.playback and opts.mode != "streaming":
        raise ClientError("--playback needs --mode streaming (an offline response is not played as it arrives)")
    if opts.capacity and (opts.max_streams < 1 or not opts.p99_bound_ms > 0 or not 0 <= opts.capacity_tolerance < 1
                          or opts.overload < 0):
        raise ClientError("--capacity needs --max-streams >= 1, --p99-bound-ms > 0, --capacity-tolerance in [0, 1) "
                          "and --overload >= 0")
    manifest = resolve_manifest(opts.set)
    items = load_manifest(manifest, opts.limit)
    n_req = opts.requests_per_level or len(items) * opts.repeat
    out = Path(opts.out)
    try:
        (out / "audio" if opts.save_audio else out).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ClientError(f"cannot create the output folder {out}: {exc}") from None
    setup = _Setup(opts, items)
    records: list[dict] = []
    levels: list[dict] = []
    capacity = None

    def run(c: int, role: str) -> dict:
        lv, recs = _level(setup, opts, items, c, n_req if role == "level" else 0, out)
        for r in recs:
            r["level"] = len(levels)
        lv["role"] = role
        lv["pass"], lv["verdict"] = level_passes(lv, opts.p99_bound_ms)
        records.extend(recs)
        levels.append(lv)
        if opts.capacity:
            echo(f"{role} {c} clients: {lv['verdict']}")
        # a run cut short (a timeout, a lost server) keeps the levels it finished
        _write_report(out, _report(opts, setup, manifest, items, n_req, levels, records, None, partial=True))
        return lv

    try:
        if opts.warmup:
            wu = [(i, items[i % len(items)], opts.seed + i % len(items)) for i in range(opts.warmup)]
            prog = Progress(len(wu), "warm-up", opts.progress)
            res, _, _ = _run_level(setup, wu, min(opts.warmup, max(opts.concurrency)), False, prog)
            prog.close()
            bad = [tr.error for *_, tr in res if tr.error]
            if len(bad) == len(res):
                raise ClientError(f"every warm-up request failed: {bad[0]}")
        if not opts.capacity:
            for c in opts.concurrency:
                run(c, "level")
        else:
            capacity = _capacity_search(run, opts, sorted(set(c for c in opts.concurrency if c <= opts.max_streams))
                                        or [opts.max_streams])
            if opts.overload > 0 and capacity["streams"] >= 1:
                c = max(capacity["streams"] + 1, int(math.ceil(opts.overload * capacity["streams"])))
                lv = run(c, "overload")
                adm = lv.get("admission") or {}
                capacity["overload"] = {
                    "factor": opts.overload, "clients": c, "ok": lv["ok"], "failed": lv["failed"],
                    "stalled": lv["stalled"],
                    "in_order": None if adm.get("out_of_order") is None else adm["out_of_order"] == 0}
    finally:
        setup.close()
    report = _report(opts, setup, manifest, items, n_req, levels, records, capacity)
    md = _write_report(out, report)
    echo(md)
    for n in report["notes"]:
        echo("note: " + n)
    png = plot(report, out / "bench.png")
    echo(f"wrote {out / 'report.json'}, {out / 'report.md'}" + (f", {png}" if png else ""))
    return report


def parse_levels(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; raises :class:`ClientError` for anything else."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ClientError(f"--concurrency must be a comma-separated list of integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ClientError(f"--concurrency values must be >= 1, got {text!r}")
    return vals


__all__ = ["BenchOptions", "run_bench", "analyze", "summarize", "playback_stalls", "stats", "markdown", "plot",
           "parse_levels", "machine_info", "level_passes", "capacity_markdown", "CosyServeError"]
