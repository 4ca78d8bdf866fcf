"""Start-up of a `cosyserve serve` process: time to ready, time until every CUDA graph is
captured, and the first-chunk latency of requests sent while the graphs are being captured in
the background (issue 18: ready <= 30 s, no stalls meanwhile).

Polls ``/v2/health/ready`` from ``--since`` (the epoch second the server was started; default:
now), then sends streaming OpenAI requests (``--concurrency`` clients back to back, each
closed after its first audio bytes: only the first chunk is measured) while
``cosyserve_graphs_pending`` on ``/metrics`` is above 0, and ``--after`` more per client once
it is 0 (the reference: every bucket graphed). Prints one summary line per phase and a final
``STARTUP`` line; ``--json`` writes everything (every request's start and latency).

    python3 benchmarks/startup_probe.py --since "$T0" --url http://127.0.0.1:8000 [--json out.json]

A server with ``--graphs-before-ready`` reports 0 pending at ready: the capture window is empty.
Exit status 1 if the server is not ready within ``--timeout`` seconds or a request fails.
"""

from __future__ import annotations

import argparse
import os
import json
import statistics
import threading
import time

import httpx

TEXT = "Hello, this is a start-up probe of the speech server. 你好，这是一个启动测试。"


def metric(client: httpx.Client, url: str, name: str) -> float | None:
    """The value of an unlabelled gauge ``name`` on ``url``/metrics (None if absent)."""
    for line in client.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def first_chunk_s(client: httpx.Client, url: str, voice: str, text: str, seed: int) -> float:
    """Seconds from sending a streaming request to its first audio bytes (then hang up)."""
    body = {"model": "tts-1", "input": text, "voice": voice, "response_format": "pcm", "seed": seed}
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/audio/speech", json=body, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        for chunk in r.iter_bytes():
            if chunk:
                return time.perf_counter() - t0
    raise RuntimeError("the response ended without audio")


def summary(lat: list[float]) -> str:
    if not lat:
        return "no requests"
    q = sorted(lat)
    p90 = q[min(len(q) - 1, int(0.9 * len(q)))]
    return (f"{len(q)} requests, first chunk p50 {statistics.median(q) * 1e3:.0f} ms, p90 {p90 * 1e3:.0f} ms, "
            f"max {q[-1] * 1e3:.0f} ms")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie of a child that has exited counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc: os.kill said it exists


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--since", type=float, default=None, help="epoch seconds the server was started (default: now)")
    ap.add_argument("--voice", default="default")
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--concurrency", type=int, default=2, help="clients sending back to back (default 2)")
    ap.add_argument("--after", type=int, default=5, help="requests per client once every graph is captured")
    ap.add_argument("--timeout", type=float, default=900, help="seconds to wait for ready and for the capture")
    ap.add_argument("--json", default=None, help="write the measurements here")
    ap.add_argument("--pid", type=int, default=None,
                    help="the server's process id: stop waiting (exit status 1) as soon as it has exited")
    args = ap.parse_args()

    t_start = args.since if args.since is not None else time.time()
    client = httpx.Client()
    while True:
        try:
            if client.get(args.url + "/v2/health/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() - t_start > args.timeout:
            print(f"STARTUP: not ready after {args.timeout:.0f} s")
            return 1
        if args.pid is not None and not _alive(args.pid):
            print(f"STARTUP: the server (pid {args.pid}) exited {time.time() - t_start:.0f} s after start, not ready")
            return 1
        time.sleep(0.1)
    t_ready = time.time()
    pending0 = metric(client, args.url, "cosyserve_graphs_pending")
    captured0 = metric(client, args.url, "cosyserve_graphs_captured")
    print(f"== ready {t_ready - t_start:.1f} s after start; CUDA graphs captured {captured0}, pending {pending0}")

    lock = threading.Lock()
    records: list[dict] = []
    state = {"t_done": None, "error": None}

    def poll() -> None:  # when did the capture finish?
        while state["t_done"] is None and state["error"] is None:
            p = metric(client, args.url, "cosyserve_graphs_pending")
            if not p:  # 0 or no such gauge (an older server): nothing is pending
                state["t_done"] = time.time()
                return
            if time.time() - t_start > args.timeout:
                state["error"] = f"graphs still pending after {args.timeout:.0f} s"
                return
            time.sleep(0.2)

    def client_loop(i: int) -> None:
        c = httpx.Client()
        left, seed = args.after, 1000 * i
        try:
            while left > 0 and state["error"] is None:
                t0 = time.time()
                in_window = state["t_done"] is None
                lat = first_chunk_s(c, args.url, args.voice, args.text, seed)
                seed += 1
                with lock:
                    records.append({"client": i, "start_s": t0 - t_start, "first_chunk_s": lat,
                                    "during_capture": in_window and state["t_done"] is None})
                if not in_window:
                    left -= 1
        except Exception as exc:  # noqa: BLE001 - reported as the probe's failure
            state["error"] = f"client {i}: {type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=poll)] + [threading.Thread(target=client_loop, args=(i,))
                                                 for i in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    during = [r["first_chunk_s"] for r in records if r["during_capture"]]
    after = [r["first_chunk_s"] for r in records if not r["during_capture"]]
    t_done = state["t_done"]
    print(f"== during the background capture: {summary(during)}")
    print(f"== after it (every bucket graphed): {summary(after)}")
    graphs_s = None if t_done is None else t_done - t_start
    capture_s = metric(client, args.url, "cosyserve_graph_capture_seconds")
    print(f"STARTUP: ready {t_ready - t_start:.1f} s, all graphs {'-' if graphs_s is None else f'{graphs_s:.1f}'} s "
          f"after start ({metric(client, args.url, 'cosyserve_graphs_captured')} buckets, "
          f"{capture_s} s in captures, {metric(client, args.url, 'cosyserve_graphs_failed')} failed); "
          f"first chunk during capture max {max(during) * 1e3 if during else float('nan'):.0f} ms "
          f"vs after max {max(after) * 1e3 if after else float('nan'):.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ready_s": t_ready - t_start, "graphs_done_s": graphs_s, "pending_at_ready": pending0,
                       "captured_at_ready": captured0, "capture_seconds": capture_s, "requests": records}, f, indent=1)
    if state["error"]:
        print(f"STARTUP: failed: {state['error']}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
