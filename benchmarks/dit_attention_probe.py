"""Probe: the Step-Audio2 DiT's streaming attention under each SDPA backend (one H100 call).

A streaming solve's attention (per layer and Euler step) has ``2B`` CFG rows x 8 heads of 64, the chunk's
new frames as queries (``T``, ~50) and keys ``T + C`` (the new frames, then the cache of prompt + 100
frames, ``C`` ~400), in the key/value buffer's layout (``kv [2B, H, T + C, 2*64]``, keys ‖ values) with the
key-padding bias ``[2B, 1, 1, T + C]`` that :func:`~cosyserve.models.fused.attention_bias` builds. Times
one call (CUDA events, median of ``--n``) per backend that takes a bias (cuDNN, efficient attention, math),
plus the unmasked flash kernel as the floor, and one time-major variant (``kv [2B, T + C, H, 2*64]``).
Prints a Markdown table.

    python3 benchmarks/dit_attention_probe.py --rows 24 --frames 50 --cache 400
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _common import gpu_ms, print_table
from torch.nn.attention import SDPBackend, sdpa_kernel

from cosyserve.models.fused import attention_bias


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=24, help="CFG rows (2 x streams)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--frames", type=int, default=50)
    ap.add_argument("--cache", type=int, default=400)
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    n, h, t, c, hd = args.rows, args.heads, args.frames, args.cache, args.head_dim
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(n, h, t, hd, device=dev, dtype=dt, generator=g)
    kv = torch.randn(n, h, t + c, 2 * hd, device=dev, dtype=dt, generator=g)
    kv_tm = kv.transpose(1, 2).contiguous()  # [N, T + C, H, 2hd]
    # padded rows as a solve has them: row i keeps t - i % 5 new frames and c - 7 * (i % 4) cached ones
    j = torch.arange(t + c, device=dev).view(1, -1)
    new = torch.tensor([t - i % 5 for i in range(n)], device=dev).view(-1, 1)
    cached = torch.tensor([c - 7 * (i % 4) for i in range(n)], device=dev).view(-1, 1)
    allowed = ((j < new) | ((j >= t) & (j < t + cached))).view(n, 1, 1, -1)
    bias = attention_bias(allowed, dt)
    k, v = kv[..., :hd], kv[..., hd:]
    k_tm, v_tm = kv_tm[..., :hd].transpose(1, 2), kv_tm[..., hd:].transpose(1, 2)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias.float())
    rows = []
    for label, backend, kk, vv, mask in (
            ("cuDNN, bias (what solves run)", SDPBackend.CUDNN_ATTENTION, k, v, bias),
            ("efficient attention, bias", SDPBackend.EFFICIENT_ATTENTION, k, v, bias),
            ("math, bias", SDPBackend.MATH, k, v, bias),
            ("cuDNN, bias, time-major kv", SDPBackend.CUDNN_ATTENTION, k_tm, v_tm, bias),
            ("efficient, bias, time-major kv", SDPBackend.EFFICIENT_ATTENTION, k_tm, v_tm, bias),
            ("flash, no mask (floor; wrong result)", SDPBackend.FLASH_ATTENTION, k, v, None)):
        try:
            with sdpa_kernel([backend]):
                def call():
                    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
                out = call()
                ms = gpu_ms(call, n=args.n, warm=10)
            err = (out.float() - ref).norm() / ref.norm() if mask is not None else float("nan")
            rows.append((label, f"{ms * 1e3:.1f}", f"{err:.1e}"))
        except RuntimeError as exc:
            rows.append((label, "n/a", str(exc).split("\n")[0][:80]))
    print_table(f"DiT attention: {n} rows x {h} heads x {hd}, {t} queries, {t + c} keys, bf16, "
                f"{torch.cuda.get_device_name()}", ["backend", "µs per call", "rel. L2 vs float32"], rows)


if __name__ == "__main__":
    main()
