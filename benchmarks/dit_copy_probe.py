"""Probe: the DiT solve's data-movement ops per layer and Euler step, each replayed from a CUDA graph.

A streaming solve runs, per layer and step, two causal convolutions as GEMMs over "columns" (each frame
with the ``k - 1`` frames before it, the stream's conv cache first) and one write of the new keys/values
into the key/value buffer. The torch profiler showed these as the slow kernels of a graphed solve on the
H100 (docs/perf.md "Session 32"); since session 33 the columns and new cache are one Triton kernel
(``cosyserve.models.conv_cols``, timed here at several tiles: ``--tiles``). This times variants of each at
the solve's shapes: ``--calls`` calls captured in one CUDA graph, replayed ``--n`` times, µs per call
(median). Prints a Markdown table.

    python3 benchmarks/dit_copy_probe.py --rows 24 --frames 50
"""

from __future__ import annotations

import argparse
import functools

import torch
from _common import gpu_ms, print_table

from cosyserve.models import conv_cols
from cosyserve.models.conv_cols import causal_cols_eager as cols_channel_major
from cosyserve.models.fused import FusedOp


def cols_tap_major(x, cache, last_idx):
    k = cache.shape[2] + 1
    n, t, c = x.shape
    xx = torch.cat([cache.transpose(1, 2).to(x.dtype), x], dim=1)
    cols = torch.cat([xx[:, j: j + t] for j in range(k)], dim=2)
    new = torch.gather(xx, 1, last_idx.unsqueeze(-1).expand(-1, -1, c))
    return cols, new.transpose(1, 2)


def graph_us(fn, calls: int, n: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return gpu_ms(g.replay, n=n, warm=1) * 1e3 / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--frames", type=int, default=50)
    ap.add_argument("--cache", type=int, default=400)
    ap.add_argument("--channels", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kernel", type=int, default=3)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--tiles", default="4x512,1x1024,2x512,8x256,8x512,16x256",
                    help="tiles (frames x column elements) of the conv-columns Triton kernel to time")
    args = ap.parse_args()
    n, t, c, k, h = args.rows, args.frames, args.channels, args.kernel, args.heads
    hd = c // h
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(n, t, c, device=dev, dtype=dt)
    cnn = torch.randn(n, 2 * c, k - 1, device=dev, dtype=dt)
    cache = cnn.split(c, dim=1)[0]  # a channel slice of the block's cache, as the solve passes it
    last_idx = (torch.full((n,), t, device=dev) - torch.arange(n, device=dev) % 3).view(-1, 1) \
        + torch.arange(k - 1, device=dev).view(1, -1)
    fused_cm, fused_tm = FusedOp(cols_channel_major, "probe_cm"), FusedOp(cols_tap_major, "probe_tm")
    kv = torch.randn(n, h, t + args.cache, 2 * hd, device=dev, dtype=dt)
    new_thd = torch.randn(n, t, h, 2 * hd, device=dev, dtype=dt)
    new_htd = new_thd.transpose(1, 2).contiguous()
    w = torch.randn(c, k * c, device=dev, dtype=dt)
    # the new cache goes to a buffer of its own, as the solve writes cnn_out while it reads cnn_in
    kernel, new_out = conv_cols._get_kernel(), torch.empty_like(cnn).narrow(1, 0, c)
    default = f"{conv_cols.BLOCK_T}x{conv_cols.BLOCK_C}"
    rows = []
    for label, fn in (
            ("conv columns, channel-major, compiled (Inductor, dynamic shapes)", lambda: fused_cm(x, cache, last_idx)),
            ("conv columns, tap-major, compiled", lambda: fused_tm(x, cache, last_idx)),
            ("conv columns, channel-major, eager ops", lambda: cols_channel_major(x, cache, last_idx)),
            ("conv columns, tap-major, eager ops", lambda: cols_tap_major(x, cache, last_idx)),
            *((f"conv columns + new cache, Triton kernel, tile {tile}{' (default)' if tile == default else ''}",
               functools.partial(conv_cols._launch, kernel, x, cache, last_idx, new_out, *map(int, tile.split("x"))))
              for tile in args.tiles.split(",") if kernel is not None),
            ("the conv's GEMM (for scale)", lambda: torch.nn.functional.linear(x.new_empty(n, t, k * c), w)),
            ("keys/values write, from [N, T, H, 2hd] (transposed view)",
             lambda: kv[:, :, :t].copy_(new_thd.transpose(1, 2))),
            ("keys/values write, from [N, H, T, 2hd] contiguous", lambda: kv[:, :, :t].copy_(new_htd))):
        try:
            rows.append((label, f"{graph_us(fn, args.calls, args.n):.1f}"))
        except Exception as exc:  # noqa: BLE001 - report and go on
            rows.append((label, f"failed: {type(exc).__name__}: {str(exc)[:60]}"))
    print_table(f"DiT solve data movement: {n} rows x {t} frames x {c} channels, k {k}, kv cache {args.cache}, "
                f"bf16, {torch.cuda.get_device_name()}, {args.calls} calls per graph", ["op", "µs per call"], rows)


if __name__ == "__main__":
    main()
