"""Cost of the disaggregated layout's token transport on the token2wav side, on the CPU: N concurrent streaming
completions (OpenAI server-sent events, one event per speech token, as ``serve --llm-only`` sends them) received
by :class:`~cosyserve.engine.token_source.RemoteTokenSource` (httpx on its private event loop) and drained by a
loop that stands in for the engine thread (wait on the source's wake-up event, ``take()`` every stream).

The stub LLM server (this file with ``--serve PORT``, uvicorn + starlette, its own process) sends each stream's
tokens at ``--rate`` tokens per second; each token's value is its send time in ms modulo the speech vocabulary,
so the receiver reads every token's transport delay without another channel. Per level prints: events per
second received (``--per-event``: tokens per event, as a server that coalesces them would send), the
receiving process's CPU (share of one core: the event loop thread and the drain loop, the
GIL the token2wav scheduler thread would share), and the delay from send to ``take()`` (p50 / p99 / max).

    python3 benchmarks/remote_token_transport.py [--streams 50,100,200] [--rate 30] [--seconds 6] [--per-event 1,4]

At 200 DiT streams the LM makes ~6,000 tokens per second (~240x real time x 25 tokens per second of audio):
docs/perf.md "Session 30". Client and server share this machine's cores: read the receiving side's CPU share
as an upper bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TEXT_VOCAB, SPEECH_VOCAB = 151663, 6561


def _serve(port: int) -> None:
    """The stub completions server (blocks)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from cosyserve.client.remote_lm import speech_vocab

    sv = speech_vocab(TEXT_VOCAB, SPEECH_VOCAB)

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    async def completions(request):
        body = await request.json()
        n, rate, per = int(body["max_tokens"]), float(body.get("rate", 30.0)), int(body.get("per_event", 1))

        async def events():
            t0 = time.monotonic()
            for i in range(0, n, per):  # `per` tokens per event, sent when the last of them is due
                k = min(per, n - i)
                delay = t0 + (i + k - 1) / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                t = int(time.time() * 1000) % SPEECH_VOCAB
                last = i + k >= n
                ev = {"id": "c", "object": "text_completion", "model": "stub",
                      "choices": [{"index": 0, "text": f"<|s_{t}|>" * k, "token_ids": [sv.speech_to_id(t)] * k,
                                   "finish_reason": "length" if last else None}]}
                yield ("data: " + json.dumps(ev) + "\n\n").encode()
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _level(url: str, streams: int, rate: float, seconds: float, per_event: int) -> dict:
    from cosyserve.client.remote_lm import StreamingCompletionsLM, speech_vocab
    from cosyserve.engine.token_source import RemoteTokenSource

    client = StreamingCompletionsLM(url, speech_vocab(TEXT_VOCAB, SPEECH_VOCAB), model="stub", timeout_s=30.0)
    client.extra = {**client.extra, "rate": rate, "per_event": per_event}
    src = RemoteTokenSource(client)
    n_tok = max(1, int(rate * seconds))
    c0, w0 = time.process_time(), time.monotonic()
    segs = [src.start([1, 2, 3], 1, n_tok, seed=i) for i in range(streams)]
    delays, got, done = [], 0, set()
    while len(done) < streams:
        src.wakeup.wait(0.02)
        src.wakeup.clear()
        for i, s in enumerate(segs):
            if i in done:
                continue
            toks, reason, err = s.take()
            if err is not None:
                raise err
            now = int(time.time() * 1000) % SPEECH_VOCAB  # after take(): every token was sent before it
            got += len(toks)
            delays += [(now - t) % SPEECH_VOCAB for t in toks]
            if reason is not None:
                done.add(i)
    wall, cpu = time.monotonic() - w0, time.process_time() - c0
    src.close()
    delays.sort()
    return {"streams": streams, "events_s": got / per_event / wall, "tokens_s": got / wall, "cpu_share": cpu / wall, "p50": delays[len(delays) // 2],
            "p99": delays[int(0.99 * (len(delays) - 1))], "max": delays[-1], "tokens": got,
            "expected": streams * n_tok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="50,100,200", help="concurrent streams per level (comma-separated)")
    ap.add_argument("--rate", type=float, default=30.0, help="tokens per second per stream")
    ap.add_argument("--seconds", type=float, default=6.0, help="each stream's length at that rate")
    ap.add_argument("--per-event", default="1", help="tokens per SSE event (comma-separated: one table row each)")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        _serve(args.serve)
        return
    port = _free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)], env=os.environ.copy())
    try:
        url = f"http://127.0.0.1:{port}"
        import httpx
        for _ in range(100):
            try:
                httpx.get(url + "/v1/models", timeout=1.0)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        print(f"{os.cpu_count()} CPU cores; {args.rate:g} tokens/s per stream\n")
        print("| streams | tokens per event | tokens/s received | events/s | receiver CPU (share of a core) | "
              "delay p50 | p99 | max | tokens |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for per in [int(x) for x in args.per_event.split(",")]:
            for n in [int(x) for x in args.streams.split(",")]:
                r = _level(url, n, args.rate, args.seconds, per)
                print(f"| {n} | {per} | {r['tokens_s']:,.0f} | {r['events_s']:,.0f} | {100 * r['cpu_share']:.0f} % | "
                      f"{r['p50']} ms | {r['p99']} ms | {r['max']} ms | {r['tokens']}/{r['expected']} |")
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
