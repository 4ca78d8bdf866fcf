"""Probe: the flow estimator's attention kernel under different ways of masking padded keys.

The estimator's self-attention runs on ``[B, H, T, D]`` (B = 2 x jobs with CFG, H = 8 heads,
D = 64) with an additive bias ``[B, 1, T, T]`` (padding, and chunk-causal rows in streaming).
This times one call per variant (CUDA events, median) at the offline shape:

* no mask (the floor: what a bias costs);
* the additive bias ``[B, 1, T, T]`` (what the estimator does);
* a key-padding bias ``[B, 1, 1, T]`` broadcast over queries (offline rows need no more);
* FlashAttention-2 varlen over the padded layout with ``seqused_k`` (no bias tensor);
* each SDPA backend that takes a bias (efficient attention, cuDNN) forced, with the full and
  the key-padding bias, and on contiguous ``[B, H, T, D]`` q/k/v (the estimator's are strided
  views of one GEMM's output);
* FlexAttention (``--flex``): the mask computed in the kernel from a per-(row, query) key limit
  (padded keys, padded queries and, with ``--streaming``, later chunks masked) with its
  block-sparse skipping of masked blocks, compiled once with dynamic shapes; the compile and
  first-call times of each new shape are printed (a recompile per shape would be too slow for
  the engine's ~150 graph buckets).

    python benchmarks/attention_probe.py --batch 32 --frames 512
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from _common import gpu_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="32", help="rows (2 x jobs with CFG), comma-separated")
    ap.add_argument("--frames", default="512", help="padded frames T, comma-separated")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--flex", action="store_true", help="also time FlexAttention")
    ap.add_argument("--streaming", action="store_true",
                    help="chunk-causal rows (chunks of --chunk frames) in the bias and the flex mask")
    ap.add_argument("--chunk", type=int, default=50)
    args = ap.parse_args()
    flex = None
    if args.flex:
        import time

        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=True)
    dtype = getattr(torch, args.dtype)
    dev = "cuda"
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}")
    print("| rows x frames | variant | ms | TFLOP/s | max abs diff vs bias |")
    print("|---|---|---:|---:|---:|")
    for b in (int(v) for v in args.batch.split(",")):
        for t in (int(v) for v in args.frames.split(",")):
            h, d = args.heads, args.head_dim
            g = torch.Generator(device=dev).manual_seed(0)
            qkv = torch.randn(b, t, 3, h, d, device=dev, dtype=dtype, generator=g)
            q, k, v = (x.transpose(1, 2) for x in qkv.unbind(2))  # [B, H, T, D] strided views, as the estimator
            lens = torch.randint(t * 3 // 4, t + 1, (b,), device=dev, generator=g)
            lens[0] = t
            keep = torch.arange(t, device=dev)[None, :] < lens[:, None]  # [B, T]
            pos = torch.arange(t, device=dev)
            # per (row, query) the keys it may see: [0, limit); chunk-causal rows stop at the end of
            # the query's chunk; padded queries see nothing (their output is never used)
            limit = lens[:, None].expand(b, t)
            if args.streaming:
                limit = torch.minimum(limit, (pos // args.chunk + 1) * args.chunk)
            limit = torch.where(pos[None] < lens[:, None], limit, 0).contiguous()
            allowed = pos[None, None, :] < limit[:, :, None]  # [B, T(q), T(k)]
            # the reference bias: padded queries keep every valid key (as the estimator's bias)
            allowed_ref = allowed | (~keep[:, :, None] & keep[:, None, :])
            full = torch.zeros(b, 1, t, t, device=dev, dtype=dtype).masked_fill(~allowed_ref[:, None], -1e10)
            kpad = torch.zeros(b, 1, 1, t, device=dev, dtype=dtype).masked_fill(~keep[:, None, None, :], -1e10)
            flops = 4 * b * h * t * t * d
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=full)
            cu = torch.arange(0, (b + 1) * t, t, device=dev, dtype=torch.int32)
            used = lens.to(torch.int32)
            q3, k3, v3 = (x.reshape(b * t, h, d) for x in qkv.unbind(2))

            def flash():
                return torch.ops.aten._flash_attention_forward(
                    q3, k3, v3, cu, cu, t, t, 0.0, False, False, seqused_k=used)[0].view(b, t, h, d).transpose(1, 2)

            qc, kc, vc = (x.contiguous() for x in (q, k, v))

            def forced(backend, mask, contiguous=False):
                def fn():
                    with sdpa_kernel([backend]):
                        args = (qc, kc, vc) if contiguous else (q, k, v)
                        return F.scaled_dot_product_attention(*args, attn_mask=mask)
                return fn

            E, C = SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION
            variants = [
                ("no mask (floor)", lambda: F.scaled_dot_product_attention(q, k, v), False),
                ("bias [B,1,T,T] (current)", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=full), True),
                ("key-padding bias [B,1,1,T]", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=kpad), True),
                ("key-padding bias expanded [B,1,T,T]",
                 lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=kpad.expand(b, 1, t, t)), True),
                ("flash varlen, seqused_k", flash, True),
                ("efficient forced, bias [B,1,T,T]", forced(E, full), True),
                ("efficient forced, bias, contiguous q/k/v", forced(E, full, True), True),
                ("cuDNN forced, bias [B,1,T,T]", forced(C, full), True),
                ("cuDNN forced, bias, contiguous q/k/v", forced(C, full, True), True),
                ("cuDNN forced, key-padding bias [B,1,1,T]", forced(C, kpad), True),
                ("cuDNN forced, no mask", forced(C, None), False),
            ]
            if flex is not None:
                def mask_mod(bi, hi, qi, ki):
                    return ki < limit[bi, qi]

                t0 = time.perf_counter()
                bm = create_block_mask(mask_mod, b, None, t, t, device=dev)
                qf, kf, vf = q, k, v

                def flex_fn():
                    return flex(qf, kf, vf, block_mask=bm)

                flex_fn()
                torch.cuda.synchronize()
                print(f"| {b} x {t} | flex: block mask + first call (compile) | {1e3 * (time.perf_counter() - t0):.0f} | | |")
                t0 = time.perf_counter()
                create_block_mask(mask_mod, b, None, t, t, device=dev)
                torch.cuda.synchronize()
                print(f"| {b} x {t} | flex: block mask again (host ms) | {1e3 * (time.perf_counter() - t0):.1f} | | |")
                variants.append(("flex, key limit per query (block-sparse)", flex_fn, True))
                variants.append(("flex block mask build (device)",
                                 lambda: create_block_mask(mask_mod, b, None, t, t, device=dev), False))
            valid_q = keep[:, None, :, None]  # compare valid queries only
            for name, fn, compare in variants:
                try:
                    out = fn()
                    if not isinstance(out, torch.Tensor):
                        out = None
                    diff = ((out - ref).abs() * valid_q).max().item() if compare and out is not None else float("nan")
                    ms = gpu_ms(fn, n=50, warm=5)
                    print(f"| {b} x {t} | {name} | {ms:.3f} | {flops / ms / 1e9:.0f} | {diff:.2e} |", flush=True)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    print(f"| {b} x {t} | {name} | failed: {type(exc).__name__}: {str(exc)[:120]} | | |", flush=True)


if __name__ == "__main__":
    main()
