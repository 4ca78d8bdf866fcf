"""In-process engine profile on one GPU: full-size CosyVoice2 architecture, random weights.

Prints tables (stage timings, first-chunk latency under concurrency, offline throughput) for
docs/perf.md. Output length is pinned with the token/text ratio (random weights never stop).

    python benchmarks/engine_profile.py --yaml benchmarks/configs/cosyvoice2-0.5b.yaml \
        --qwen-config benchmarks/configs/CosyVoice-BlankEN-config.json --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from cosyserve.engine.chunking import ChunkPolicy
from cosyserve.engine.core import EngineConfig
from cosyserve.engine.pipeline import Synthesizer
from cosyserve.engine.request import AudioChunk, SynthesisParams
from cosyserve.models.demo import write_frontend_dir
from cosyserve.models.llm import KVCache
from cosyserve.models.loader import build_random

ROOT = Path(__file__).resolve().parent.parent
PROMPT = ROOT / "cosyserve" / "assets" / "prompts" / "zero_shot_prompt.wav"
TEXTS = ["收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。",
         "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest.",
         "今天天气很好，我们一起去公园散步吧，顺便看看湖边新开的花。",
         "Streaming text to speech must start playing quickly and never stall while it plays."]


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, n=10, warm=3):
    for _ in range(warm):
        fn()
    sync()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def run_concurrent(syn, voice, n, policy, ratio, max_active, seed0=0):
    """n requests submitted at once; returns per-request first-chunk latency, stalls, audio, wall."""
    eng = syn.new_engine(EngineConfig(max_active=max_active, max_queue=1024, kv_max_len=2048,
                                      max_t2w_batch=max_active, graph_capture="startup"))  # graphs from the start
    reqs = [syn.build_request(TEXTS[i % len(TEXTS)], voice, SynthesisParams(
        seed=seed0 + i, stream=True, chunk_policy=policy, min_token_text_ratio=ratio, max_token_text_ratio=ratio),
        f"r{i}") for i in range(n)]
    t0 = time.monotonic()
    for r in reqs:
        r.arrival = t0
        eng.add_request(r)
    first, arrivals, audio = {}, {r.request_id: [] for r in reqs}, {r.request_id: 0.0 for r in reqs}
    while eng.has_work():
        for ev in eng.step():
            now = time.monotonic()
            if isinstance(ev, AudioChunk):
                first.setdefault(ev.request_id, now - t0)
                arrivals[ev.request_id].append((now - t0, ev.duration_s))
                audio[ev.request_id] += ev.duration_s
    wall = time.monotonic() - t0
    stalls = 0
    for rid, chs in arrivals.items():
        play_end = None
        for t, d in chs:
            if play_end is not None and t > play_end + 1e-3:
                stalls += 1
            play_end = (t if play_end is None else max(play_end, t)) + d
    return list(first.values()), stalls, sum(audio.values()), wall, eng.stats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--yaml", default=str(ROOT / "benchmarks/configs/cosyvoice2-0.5b.yaml"))
    ap.add_argument("--qwen-config", default=str(ROOT / "benchmarks/configs/CosyVoice-BlankEN-config.json"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ratio", type=float, default=6.0, help="speech tokens per text token (pinned)")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--offline", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    t = time.time()
    models = build_random(args.yaml, device=args.device, dtype=dtype, qwen_config_path=args.qwen_config)
    md = write_frontend_dir(args.yaml, args.qwen_config, tempfile.mkdtemp())
    syn = Synthesizer(md, models=models, normalizer="rules")
    voice = syn.make_voice("bench", PROMPT, "希望你以后能够做的比我还好呦。")
    print(f"loaded in {time.time() - t:.1f} s on {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}; "
          f"prompt {voice.flow_speech_token.numel()} tokens")
    res = {}

    # ---- stage timings
    lm = models.llm
    cache = KVCache.allocate(lm, 64, 1024)
    rows = []
    with torch.inference_mode():
        pre = lm.embed_prefix(torch.arange(40), voice.prompt_text_ids, voice.llm_speech_token)
        rows.append(("LM prefill", f"1 x {pre.shape[0]} tok", timed(
            lambda: lm.forward_cached(pre[None], cache, torch.tensor([0]), torch.tensor([0])))))
        for b in (1, 8, 32, 64):
            emb = lm.embed_speech(torch.randint(0, 6561, (b, 1)))
            slots, start = torch.arange(b), torch.full((b,), 300)
            rows.append(("LM decode step", f"batch {b}", timed(lambda: lm.logprobs(
                lm.forward_cached(emb, cache, slots, start)[:, -1]).cpu())))
        from cosyserve.engine.token2wav import Token2Wav, Token2WavJob
        from cosyserve.models.hift import HiFTStreamState
        t2w = Token2Wav(models.flow, models.hift, models.cfg.token_mel_ratio)
        for b, n in ((1, 18), (1, 28), (8, 28), (32, 28)):
            jobs = [Token2WavJob(voice, torch.randint(0, 6561, (n,)), 0, False, True, HiFTStreamState(), None)
                    for _ in range(b)]
            mels = lambda: models.flow.inference_batch([j.tokens[None].to(args.device) for j in jobs],
                                                        [voice.flow_speech_token[None]] * b,
                                                        [voice.speech_feat[None]] * b,
                                                        torch.stack([voice.flow_embedding] * b).to(args.device),
                                                        streaming=True, finalize=False)
            rows.append(("flow (10 steps, CFG)", f"batch {b}, first chunk {n} tok", timed(mels, n=5, warm=2)))
            rows.append(("token2wav chunk (flow+HiFT)", f"batch {b}, first chunk {n} tok",
                         timed(lambda: t2w.run(jobs), n=5, warm=2)))
        # the same stages as CUDA graphs (what the engine uses on CUDA)
        if args.device == "cuda":
            from cosyserve.models.graphs import GraphedDecoder, GraphedFlow

            gcache = KVCache.allocate(lm, 65, 1024)
            dec = GraphedDecoder(lm, gcache, 64)
            for b in (1, 8, 32, 64):
                toks, slots, start = torch.randint(0, 6561, (b,)), torch.arange(b), torch.full((b,), 300)
                rows.append(("LM decode step, CUDA graph", f"batch {b}", timed(lambda: dec(toks, slots, start).cpu())))
            models.flow.graph = GraphedFlow(models.flow, 64)
            for b, n in ((1, 18), (1, 28), (8, 28), (32, 28), (64, 28)):
                jobs = [Token2WavJob(voice, torch.randint(0, 6561, (n,)), 0, False, True, HiFTStreamState(), None)
                        for _ in range(b)]
                rows.append(("token2wav chunk, flow graphed", f"batch {b}, first chunk {n} tok",
                             timed(lambda: t2w.run(jobs), n=5, warm=2)))
    print("\n| stage | shape | median ms |\n|---|---|---:|")
    for name, shape, s in rows:
        print(f"| {name} | {shape} | {s * 1000:.1f} |")
    res["stages"] = [{"stage": a, "shape": b, "ms": c * 1000} for a, b, c in rows]

    # ---- streaming first-chunk latency
    print("\n| policy | streams | first-chunk p50 ms | p90 ms | max ms | stalls | audio s | wall s | RTF |"
          "\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    res["streaming"] = []
    for pol in ("exponential", "upstream"):
        policy = ChunkPolicy.parse(pol)
        run_concurrent(syn, voice, 1, policy, args.ratio, 1)  # warm-up
        for n in [int(x) for x in args.concurrency.split(",")]:
            if pol == "upstream" and n > 1:
                continue
            run_concurrent(syn, voice, n, policy, args.ratio, max(n, 1), seed0=10_000)  # warm: capture buckets
            first, stalls, audio, wall, st = run_concurrent(syn, voice, n, policy, args.ratio, max(n, 1))
            row = {"policy": pol, "streams": n, "p50": pct(first, 50) * 1e3, "p90": pct(first, 90) * 1e3,
                   "max": max(first) * 1e3, "stalls": stalls, "audio_s": audio, "wall_s": wall,
                   "rtf": wall / audio * n if audio else None}
            res["streaming"].append(row)
            print(f"| {pol} | {n} | {row['p50']:.0f} | {row['p90']:.0f} | {row['max']:.0f} | {stalls} | "
                  f"{audio:.1f} | {wall:.2f} | {wall * n / audio:.3f} |")

    # ---- offline throughput
    if args.offline:
        for warm in (True, False):
            eng = syn.new_engine(EngineConfig(max_active=args.offline, max_queue=0, kv_max_len=2048,
                                              max_t2w_batch=args.offline, graph_capture="startup"))
            reqs = [syn.build_request(TEXTS[i % len(TEXTS)], voice, SynthesisParams(
                seed=i, stream=False, min_token_text_ratio=args.ratio, max_token_text_ratio=args.ratio), f"o{i}")
                for i in range(args.offline)]
            t0 = time.monotonic()
            for r in reqs:
                eng.add_request(r)
            audio = 0.0
            while eng.has_work():
                for ev in eng.step():
                    if isinstance(ev, AudioChunk):
                        audio += ev.duration_s
            wall = time.monotonic() - t0
        res["offline"] = {"requests": args.offline, "audio_s": audio, "wall_s": wall, "rtf": wall / audio}
        print(f"\noffline: {args.offline} requests in flight, {audio:.1f} s audio in {wall:.2f} s: "
              f"RTF {wall / audio:.4f} ({audio / wall:.0f} s of audio per second)")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
