"""Where the GPU's time goes under the offline workload: a CUDA kernel profile of the engine.

Full-size CosyVoice2 architecture, random weights, in-process engine (no server), the benchmark
set's texts with one registered voice, ``--clients`` offline requests kept in flight (closed
loop: a finished request is replaced at once). After ``--warm`` seconds, ``--window`` seconds
are profiled with torch.profiler (CUDA kernels only) and summarised:

* audio seconds produced per wall second in the window (the offline throughput);
* per CUDA stream (the LM's high-priority stream, token2wav's side stream): kernel time as a
  share of the window, and the union of all streams (how busy the GPU was);
* kernel time by stage and kernel class (GEMM, attention, convolution, FFT, elementwise, ...),
  and the top kernels.

    python benchmarks/offline_profile.py --clients 64 --warm 6 --window 4

Output length is pinned with the token/text ratio (random weights never stop). Prints tables.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import tempfile
import time
from pathlib import Path

import torch
from _common import add_model_args

from cosyserve.client.manifest import load_manifest
from cosyserve.engine.core import EngineConfig
from cosyserve.engine.pipeline import Synthesizer
from cosyserve.engine.request import AudioChunk, RequestFinished, SynthesisParams
from cosyserve.models.demo import write_frontend_dir
from cosyserve.models.loader import build_random


CLASSES = [  # (class, substrings of the kernel name), first match wins
    ("attention (SDPA)", ("fmha", "flash", "attention", "efficient_attention", "cutlass::Kernel")),
    ("GEMM", ("gemm", "sm90_xmma", "cublas", "nvjet", "splitK", "ampere_", "sm80_")),
    ("convolution", ("conv", "cudnn", "implicit", "winograd", "fprop", "dgrad")),
    ("FFT", ("fft", "FFT")),
    ("norm", ("norm", "Norm")),
    ("reduction / softmax", ("reduce", "softmax", "Softmax", "argmax", "topk", "sort", "scan", "cumsum")),
    ("copy / index", ("copy", "Copy", "index", "Index", "gather", "scatter", "cat", "Cat", "memcpy", "memset", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "Elementwise")),
]


def kernel_class(name: str) -> str:
    for cls, keys in CLASSES:
        if any(k in name for k in keys):
            return cls
    return "other"


def union_ms(spans: list[tuple[float, float]]) -> float:
    """Total length (ms) of the union of ``(start_us, end_us)`` spans."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--ratio", type=float, default=6.0)
    ap.add_argument("--warm", type=float, default=6.0, help="seconds before the profiled window")
    ap.add_argument("--window", type=float, default=4.0, help="profiled seconds")
    ap.add_argument("--lazy", action="store_true", help="no graph capture at start-up")
    ap.add_argument("--trace", default=None, help="also write the chrome trace here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    models = build_random(args.yaml, device=args.device, dtype=dtype, qwen_config_path=args.qwen_config)
    md = write_frontend_dir(args.yaml, args.qwen_config, tempfile.mkdtemp())
    syn = Synthesizer(md, models=models, normalizer="rules")
    items = load_manifest(None)
    voice = syn.make_voice("bench", items[0].prompt_wav, items[0].prompt_text)
    eng = syn.new_engine(EngineConfig(max_active=args.clients, max_queue=4 * args.clients,
                                      graph_warmup=not args.lazy, t2w_graph_warmup=not args.lazy))
    eng.warmup()
    print(f"engine ready in {time.perf_counter() - t0:.1f} s", flush=True)

    n_sent = 0

    def submit():
        nonlocal n_sent
        it = items[n_sent % len(items)]
        eng.add_request(syn.build_request(it.target_text, voice, SynthesisParams(
            seed=n_sent, stream=False, min_token_text_ratio=args.ratio, max_token_text_ratio=args.ratio),
            f"o{n_sent}"))
        n_sent += 1

    for _ in range(args.clients):
        submit()
    audio = 0.0
    finished = 0

    def run_for(seconds: float) -> None:
        nonlocal audio, finished
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for ev in eng.step():
                if isinstance(ev, AudioChunk):
                    audio += ev.duration_s
                elif isinstance(ev, RequestFinished):
                    finished += 1
                    submit()

    import faulthandler

    faulthandler.dump_traceback_later(args.warm + args.window + 240, exit=True)  # a stuck engine shows where
    w0 = time.monotonic()
    run_for(args.warm)
    print(f"warm-up {time.monotonic() - w0:.1f} s: {audio:.1f} s of audio, {finished} requests finished "
          f"({audio / (time.monotonic() - w0):.1f}x real time, unprofiled, from a cold start)", flush=True)
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    a0, f0, w0 = audio, finished, time.monotonic()
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        run_for(args.window)
        if cuda:
            torch.cuda.synchronize()
    wall = time.monotonic() - w0
    gpu = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"\nwindow {wall:.2f} s: {audio - a0:.1f} s of audio, {finished - f0} requests finished: "
          f"**{(audio - a0) / wall:.1f}x real time** ({args.clients} offline requests in flight, "
          f"{gpu}, torch {torch.__version__}, {args.dtype})")

    path = Path(args.trace or tempfile.mktemp(suffix=".json"))
    t = time.perf_counter()
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    print(f"trace: {len(events)} events, exported and read in {time.perf_counter() - t:.1f} s", flush=True)
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not kernels:
        print("no kernel events in the trace")
        return
    lo = min(e["ts"] for e in kernels)
    hi = max(e["ts"] + e["dur"] for e in kernels)
    span = (hi - lo) / 1e3
    by_stream: dict[int, list] = collections.defaultdict(list)
    for e in kernels:
        by_stream[e.get("args", {}).get("stream", -1)].append(e)
    print(f"\nGPU kernel time in the window ({span:.0f} ms from first to last kernel):\n")
    print("| stream | kernels | kernel ms | % of window | busy (union) % |\n|---|---:|---:|---:|---:|")
    for s, evs in sorted(by_stream.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
        tot = sum(e["dur"] for e in evs) / 1e3
        u = union_ms([(e["ts"], e["ts"] + e["dur"]) for e in evs])
        print(f"| {s} | {len(evs)} | {tot:.0f} | {100 * tot / span:.0f} | {100 * u / span:.0f} |")
    u = union_ms([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    print(f"| all | {len(kernels)} | {sum(e['dur'] for e in kernels) / 1e3:.0f} | | **{100 * u / span:.0f}** |")

    print("\nKernel time by stream and class (ms in the window):\n")
    print("| stream | class | kernels | ms | mean µs |\n|---|---|---:|---:|---:|")
    for s, evs in sorted(by_stream.items()):
        agg = collections.defaultdict(lambda: [0, 0.0])
        for e in evs:
            a = agg[kernel_class(e["name"])]
            a[0] += 1
            a[1] += e["dur"]
        for cls, (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
            print(f"| {s} | {cls} | {n} | {us / 1e3:.1f} | {us / n:.1f} |")

    print("\nTop 30 kernels (all streams):\n")
    print("| stream | kernel | calls | ms | mean µs |\n|---|---|---:|---:|---:|")
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        a = agg[(e.get("args", {}).get("stream", -1), e["name"][:110])]
        a[0] += 1
        a[1] += e["dur"]
    for (s, name), (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:30]:
        print(f"| {s} | `{name}` | {n} | {us / 1e3:.1f} | {us / n:.1f} |")


if __name__ == "__main__":
    main()
