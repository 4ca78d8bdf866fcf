"""Host work of a DiT (Step-Audio2) streaming chunk batch, counted on the CPU: aten operators dispatched
per ``DitToken2Wav.stream_step_batch`` call at several batch sizes, and which operators grow with the
batch (per-stream copies, clones, pads). On a GPU each of these is a kernel launch or host bookkeeping
issued by the scheduler thread, which the H100 runs showed to be the DiT path's bound (docs/perf.md,
"Session 23": 43-56 % of the scheduler thread issuing token2wav batches). A proxy that needs no GPU, so
a change that removes per-stream work can be checked here before it is measured on one.

    python3 benchmarks/dit_host_ops.py [--batches 1,2,6] [--prompt-tokens 40] [--chunk 25]

Tiny random-weight model (``write_token2wav_dir``), eager solve (on CUDA the solve is one graph: its
operators are not host work there, so compare the growth with the batch rather than the totals).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cosyserve.models.dit_token2wav import TINY_SIZE, load_dit_token2wav, write_token2wav_dir  # noqa: E402


def _counts(t2w, batch: int, prompt_tokens: int, chunk: int, warm_chunks: int, g: torch.Generator) -> dict:
    states = []
    for _ in range(batch):
        pt = torch.randint(0, 6561, (prompt_tokens,), generator=g)
        states.append(t2w.stream_setup(pt, torch.randn(2 * prompt_tokens, 80, generator=g), torch.randn(192, generator=g)))
    la = t2w.flow.pre_lookahead_len

    def step(states):
        toks = [torch.randint(0, 6561, (chunk + la,), generator=g) for _ in states]
        return [s for _, s in t2w.stream_step_batch(states, toks, [False] * len(states))]

    for _ in range(warm_chunks):  # steady state: caches at their trimmed length
        states = step(states)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(states)
    return {e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,6")
    ap.add_argument("--prompt-tokens", type=int, default=40)
    ap.add_argument("--chunk", type=int, default=25, help="new tokens per chunk (plus the look-ahead)")
    ap.add_argument("--warm-chunks", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        t2w = load_dit_token2wav(write_token2wav_dir(Path(d) / "t2w", TINY_SIZE))
    g = torch.Generator().manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    counts = {b: _counts(t2w, b, args.prompt_tokens, args.chunk, args.warm_chunks, g) for b in batches}
    base = batches[0]
    for b in batches:
        total = sum(counts[b].values())
        extra = (total - sum(counts[base].values())) / (b - base) if b != base else 0.0
        print(f"batch {b}: {total} aten ops ({total / b:.0f} per stream; {extra:.0f} more per extra stream)")
    top = batches[-1]
    grow = sorted(((counts[top].get(k, 0) - counts[base].get(k, 0)) / max(1, top - base), k)
                  for k in set(counts[top]) | set(counts[base]))
    print("per extra stream:", ", ".join(f"{k} {n:.0f}" for n, k in reversed(grow[-10:]) if n > 0))


if __name__ == "__main__":
    main()
