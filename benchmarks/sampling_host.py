"""Host time of speech-token sampling per LM step: per-row UpstreamSampler.sample vs sample_batch.

Runs on the CPU (sampling is host work in the engine). Prints a table for docs/perf.md.

    python benchmarks/sampling_host.py [--batches 1,8,32,64] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cosyserve.models.config import SamplingConfig
from cosyserve.models.sampling import UpstreamSampler


def median_ms(fn, n=30, warm=3):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # upstream CosyVoice2 RAS settings (cosyvoice2.yaml): top_p 0.8, top_k 25, win_size 10, tau_r 0.1
    s = UpstreamSampler(SamplingConfig(top_p=0.8, top_k=25, win_size=10, tau_r=0.1), eos_id=6561)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| rows | per-row sample() ms | sample_batch() ms | speed-up |\n|---:|---:|---:|---:|")
    for b in [int(x) for x in args.batches.split(",")]:
        logp = (torch.randn(b, 6564) * 3).log_softmax(-1)
        gens = [torch.Generator().manual_seed(i) for i in range(b)]
        dec = [list(range(i, i + 10)) for i in range(b)]
        one = median_ms(lambda: [s.sample(logp[i], dec[i], gens[i]) for i in range(b)])
        many = median_ms(lambda: s.sample_batch(logp, dec, gens, [False] * b))
        print(f"| {b} | {one:.2f} | {many:.2f} | {one / many:.1f}× |")


if __name__ == "__main__":
    main()
