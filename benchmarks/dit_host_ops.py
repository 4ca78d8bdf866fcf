"""Host work of a DiT (Step-Audio2) streaming chunk batch, counted on the CPU: aten operators dispatched
per ``DitToken2Wav.stream_step_batch`` call at several batch sizes, and which operators grow with the
batch (per-stream copies, clones, pads). On a GPU each of these is a kernel launch or host bookkeeping
issued by the scheduler thread, which the H100 runs showed to be the DiT path's bound (docs/perf.md,
"Session 23": 43-56 % of the scheduler thread issuing token2wav batches). A proxy that needs no GPU, so
a change that removes per-stream work can be checked here before it is measured on one.

    python3 benchmarks/dit_host_ops.py [--batches 1,2,6] [--prompt-tokens 40] [--chunk 25] [--phases] [--padded]
        [--hift-f0 batched]

``--phases`` also splits the per-extra-stream growth by where the operators run (flow encoder, flow
solve, HiFT F0, HiFT excitation draws, HiFT decode, the rest of the HiFT streaming step, the rest):
each operator counts for the innermost of those calls it runs in; with ``--phases`` the totals per
phase of the largest batch are printed too.

``--padded``: the flow encoder runs in its padded static-shape form (``DitFlowModel._encode_padded``,
eagerly), and the phase "flow encoder graph body" counts what a CUDA graph replays in one launch
(``_encode_static``); "flow encoder" then counts the host work left around the replay (inputs into
the static tensors, gathering the new caches).

Tiny random-weight model (``write_token2wav_dir``), eager solve (on CUDA the solve is one graph: its
operators are not host work there, so compare the growth with the batch rather than the totals).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import ops_by_phase, phase_ranges  # noqa: E402

import cosyserve.models.dit_token2wav as dit_t2w  # noqa: E402
from cosyserve.models.dit_token2wav import (  # noqa: E402
    TINY_SIZE,
    load_dit_token2wav,
    write_token2wav_dir,
)

#: phase label -> the (object, attribute) pairs wrapped in a profiler range while ``--phases`` counts
PHASES = {"flow encoder": [("flow", "_encode")], "flow solve": [("flow", "_solve")],
          "HiFT F0": [("hift", "predict_f0"), ("hift", "predict_f0_batched")],
          "HiFT excitation": [("hift", "excitation_padded")], "HiFT decode": [("hift", "decode")],
          "HiFT stream step (rest)": [("module", "hift_stream_step_batch")]}


#: with ``--padded``: the part of the padded encoder that a CUDA graph replays
PADDED_PHASES = {"flow encoder graph body": [("flow", "_encode_static")]}


def _phases(t2w, padded: bool = False) -> dict:
    """:data:`PHASES` (and :data:`PADDED_PHASES` when ``padded``) with the objects of ``t2w`` (for
    :func:`_common.phase_ranges`)."""
    owners = {"flow": t2w.flow, "hift": t2w.hift, "module": dit_t2w}
    table = {**PHASES, **(PADDED_PHASES if padded else {})}
    return {label: [(owners[owner], attr) for owner, attr in sites] for label, sites in table.items()}


@contextlib.contextmanager
def _padded_encoder(flow):
    """``flow._encode`` replaced by the padded static-shape form (the batch's own bucket), eagerly."""

    def encode(items, trim_keep=None, keep_state=None, check_device_tokens=False, token_lists=None):
        return flow._encode_padded(items, trim_keep=trim_keep, keep_state=keep_state,
                                   check_device_tokens=check_device_tokens)

    flow._encode = encode
    try:
        yield
    finally:
        del flow._encode


def _counts(t2w, batch: int, prompt_tokens: int, chunk: int, warm_chunks: int, g: torch.Generator,
            phases: bool = False, padded: bool = False) -> tuple[dict, dict]:
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
    with _padded_encoder(t2w.flow) if padded else contextlib.nullcontext():
        with phase_ranges(_phases(t2w, padded)) if phases else contextlib.nullcontext():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step(states)
    ops = {e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")}
    return ops, (ops_by_phase(prof) if phases else {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,6")
    ap.add_argument("--prompt-tokens", type=int, default=40)
    ap.add_argument("--chunk", type=int, default=25, help="new tokens per chunk (plus the look-ahead)")
    ap.add_argument("--warm-chunks", type=int, default=4)
    ap.add_argument("--phases", action="store_true", help="split the per-extra-stream growth by phase")
    ap.add_argument("--padded", action="store_true",
                    help="the flow encoder in its padded static-shape form (what the CUDA graph replays)")
    ap.add_argument("--hift-f0", choices=["per-item", "batched"], default="per-item",
                    help="HiFT F0 item by item (default) or in one masked float64 pass (serve --hift-f0)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        t2w = load_dit_token2wav(write_token2wav_dir(Path(d) / "t2w", TINY_SIZE))
    t2w.hift.batched_f0 = args.hift_f0 == "batched"
    g = torch.Generator().manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    both = {b: _counts(t2w, b, args.prompt_tokens, args.chunk, args.warm_chunks, g, args.phases, args.padded)
            for b in batches}
    counts = {b: c for b, (c, _) in both.items()}
    base = batches[0]
    for b in batches:
        total = sum(counts[b].values())
        extra = (total - sum(counts[base].values())) / (b - base) if b != base else 0.0
        print(f"batch {b}: {total} aten ops ({total / b:.0f} per stream; {extra:.0f} more per extra stream)")
    top = batches[-1]
    grow = sorted(((counts[top].get(k, 0) - counts[base].get(k, 0)) / max(1, top - base), k)
                  for k in set(counts[top]) | set(counts[base]))
    print("per extra stream:", ", ".join(f"{k} {n:.0f}" for n, k in reversed(grow[-10:]) if n > 0))
    labels = [*PHASES, *(PADDED_PHASES if args.padded else {}), "other"]
    if args.phases:
        for b in batches:
            pb = both[b][1]
            print(f"batch {b} by phase:", ", ".join(f"{k} {pb.get(k, 0)}" for k in labels))
    if args.phases and top != base:
        pa, pb = both[base][1], both[top][1]
        print("per extra stream by phase:", ", ".join(
            f"{k} {(pb.get(k, 0) - pa.get(k, 0)) / (top - base):.0f}" for k in labels))


if __name__ == "__main__":
    main()
