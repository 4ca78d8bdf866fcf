"""Host cost of issuing one token2wav batch (``Token2Wav.launch`` on a side stream) on one GPU.

Full-size CosyVoice2 architecture, random weights, CUDA graphs for the flow and HiFT as the
engine uses them. For each batch size: the host time of ``launch`` (median, the GPU idle at
the start), the GPU time until the batch is done, then a ``torch.profiler`` table of the
host-side operators of one launch at the largest batch (self CPU time), and any synchronising
CUDA call reported by ``torch.cuda.set_sync_debug_mode("warn")``.

    python benchmarks/launch_profile.py --batches 1,4,16
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from _common import add_model_args

from cosyserve.engine.token2wav import Token2Wav, Token2WavJob
from cosyserve.frontend.voice import Voice
from cosyserve.models.graphs import GraphedFlow, GraphedHiFTDecoder
from cosyserve.models.hift import HiFTStreamState
from cosyserve.models.loader import build_random


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap, device=False)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--tokens", type=int, default=68, help="speech tokens per job (look-ahead included)")
    args = ap.parse_args()
    m = build_random(args.yaml, device="cuda", dtype=getattr(torch, args.dtype), qwen_config_path=args.qwen_config,
                     components=("flow", "hift"))
    batches = [int(b) for b in args.batches.split(",")]
    m.flow.graph = GraphedFlow(m.flow, max(batches))
    m.hift.graph_decode = GraphedHiFTDecoder(m.hift, max(batches))
    t2w = Token2Wav(m.flow, m.hift, m.cfg.token_mel_ratio)
    g = torch.Generator().manual_seed(0)
    voice = Voice.from_features("v", "x", torch.randint(0, 1000, (8,), generator=g),
                                torch.randint(0, 6561, (87,), generator=g), torch.randn(174, 80, generator=g),
                                torch.randn(192, generator=g))
    side = torch.cuda.Stream()

    def jobs(b):
        return [Token2WavJob(voice, torch.randint(0, 6561, (args.tokens,), generator=g), 15, False, True,
                             HiFTStreamState(), torch.Generator(device="cuda").manual_seed(i)) for i in range(b)]

    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, {args.tokens} tokens per job")
    print("| batch | launch host ms (median) | launch -> done ms |\n|---:|---:|---:|")
    for b in batches:
        for _ in range(3):  # capture + warm
            t2w.finish(t2w.launch(jobs(b), stream=side))
        host, total = [], []
        for _ in range(7):
            js = jobs(b)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pending = t2w.launch(js, stream=side)
            host.append((time.perf_counter() - t0) * 1e3)
            t2w.finish(pending)
            total.append((time.perf_counter() - t0) * 1e3)
        print(f"| {b} | {statistics.median(host):.1f} | {statistics.median(total):.1f} |", flush=True)

    b = max(batches)
    js = jobs(b)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                pending = t2w.launch(js, stream=side)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    t2w.finish(pending)
    print(f"\nsynchronising calls during one launch of batch {b}: {len(caught)}")
    for w in caught[:10]:
        print("  ", str(w.message).splitlines()[0][:160])
    print(f"\nhost operators of one launch, batch {b} (self CPU time):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
