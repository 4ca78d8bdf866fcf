"""Kernels per DiT (Step-Audio2) solve, counted on the CPU: the operators a CUDA graph of
``DitFlowModel._euler`` replays, one per kernel launch on the GPU.

The solve is bound by its number of small kernels, not by arithmetic (docs/perf.md, "Session 28"), so
this count is the proxy for a change that fuses kernels, checkable without a GPU. It runs one padded
streaming solve (the form the graphs capture: rows with lengths and a key mask) of the tiny
random-weight model and counts every aten operator dispatched inside ``_euler`` that launches work:
view and metadata operators are skipped, and a call of a fused op (:class:`cosyserve.models.fused.FusedOp`,
one compiled kernel on CUDA, possibly two) or of the causal convolutions' columns
(:func:`cosyserve.models.conv_cols.causal_cols`, one Triton kernel on CUDA) counts once. Counts per layer and evaluation do not depend on
the model's widths, so the full-size solve is ``depth x n_timesteps`` times the per-layer count plus the
per-evaluation rest (printed for the released depth, 16).

    python3 benchmarks/dit_solve_kernels.py [--streams 4] [--depth 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cosyserve.models import dit_flow, fused  # noqa: E402
from cosyserve.models.dit_flow import DitFlowModel  # noqa: E402
from cosyserve.models.dit_token2wav import TINY_SIZE, load_dit_token2wav, write_token2wav_dir  # noqa: E402

#: operators that launch no kernel on CUDA (allocation without fill, metadata)
_NO_KERNEL = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
              "_to_copy_noop", "is_nonzero", "sym_size", "sym_stride", "sym_numel", "alias", "_unsafe_view")


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.fused_depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.fused_depth == 0 and not func.is_view and name not in _NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def count(flow: DitFlowModel, streams: int) -> Counter:
    """Operators of the solve of one padded chunk batch of ``streams`` streams (after a set-up and one chunk)."""
    g = torch.Generator().manual_seed(0)
    prompts = [(torch.randint(0, 6561, (n,), generator=g), torch.randn(2 * n, 80, generator=g),
                torch.randn(192, generator=g)) for n in (17, 11, 23, 6)[: max(1, streams)] * (1 + streams // 4)][:streams]
    states = flow.setup_batch(prompts)
    toks = [torch.randint(0, 6561, (28,), generator=g) for _ in states]
    states = [s for _, s in flow.chunk_batch(states, toks, [False] * len(states))]
    mode = _Count()
    euler = DitFlowModel._euler
    call = fused.FusedOp.__call__
    cols = dit_flow.causal_cols

    def once(name, fn, *args):  # one kernel on CUDA, whatever it dispatches on the CPU
        if mode.fused_depth == 0:
            mode.ops[name] += 1
        mode.fused_depth += 1
        try:
            return fn(*args)
        finally:
            mode.fused_depth -= 1

    def counted_fused(self, *args):
        return once(f"fused:{self.name}", call, self, *args)

    def counted_cols(*args):
        return once("kernel:causal_cols", cols, *args)

    def counted_euler(self, bufs, n):
        with mode:
            return euler(self, bufs, n)

    fused.FusedOp.__call__, DitFlowModel._euler, dit_flow.causal_cols = counted_fused, counted_euler, counted_cols
    try:
        flow.chunk_batch(states, [torch.randint(0, 6561, (28,), generator=g) for _ in states], [False] * len(states))
    finally:
        fused.FusedOp.__call__, DitFlowModel._euler, dit_flow.causal_cols = call, euler, cols
    return mode.ops


def solve_kernels(size=TINY_SIZE, streams: int = 4) -> tuple[dict, float, int]:
    """``(kernels per layer and evaluation by operator, kernels per evaluation outside the layers,
    Euler steps)`` of a padded streaming solve of random-weight flows at ``size`` and one layer deeper."""
    flows = []
    for depth in (size.dit_depth, size.dit_depth + 1):
        with tempfile.TemporaryDirectory() as tmp:
            flow = load_dit_token2wav(write_token2wav_dir(Path(tmp) / "t2w", dataclasses.replace(size, dit_depth=depth))).flow
        flow.enable_cuda_graphs(frames_bucket=25, cache_bucket=64)  # the padded form the graphs capture (eager here)
        flows.append(flow)
    steps = flows[0].cfg.n_timesteps
    a, b = count(flows[0], streams), count(flows[1], streams)
    per_layer = {k: (b[k] - a[k]) / steps for k in set(a) | set(b) if b[k] != a[k]}
    rest = (sum(a.values()) - sum(per_layer.values()) * steps * size.dit_depth) / steps
    return per_layer, rest, steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--depth", type=int, default=16, help="depth to extrapolate to (the released DiT: 16)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    per_layer, rest, steps = solve_kernels(TINY_SIZE, args.streams)
    layer = sum(per_layer.values())
    print(f"DiT solve, {args.streams} streams, {steps} steps: "
          f"{layer * steps * TINY_SIZE.dit_depth + rest * steps:.0f} kernels at depth {TINY_SIZE.dit_depth}")
    print("\nper layer and evaluation:")
    print("| operator | kernels |\n|---|---:|")
    for k, v in sorted(per_layer.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"| {k} | {v:g} |")
    print(f"| **total** | **{layer:g}** |")
    print(f"\nper evaluation outside the layers: {rest:g}")
    print(f"at depth {args.depth}: {(layer * args.depth + rest) * steps:.0f} kernels per solve")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
