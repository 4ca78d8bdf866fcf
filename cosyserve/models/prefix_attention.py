"""Attention of a prefixed flow solve that reads the voice prefixes where the pool holds them: one Triton kernel.

A prefixed Euler step (:mod:`cosyserve.models.flow_prefix`) attends, per U-Net attention site, from each row's
new frames to the keys/values of its voice's prompt prefix (pool slot, Euler step, site, CFG row) followed by
its own new keys/values. Eagerly (:meth:`~cosyserve.models.flow_prefix.PrefixStepIO.keys_values` + SDPA with
the plan's additive bias) that is, per site, two gathers of every row's ``[2, H, S, D]`` prefix (``S``: the
pool's ``max_frames``, whatever the prefix's length), two concatenations with the new ones and a masked
attention over ``S + Tn`` keys, four more kernels per site and step: on an H100 that made the prefixed solve
slower than recomputing the prefix (first chunk at one stream 51 vs 34 ms of token2wav; docs/perf.md "Session 36"). :func:`prefix_attention` is a
FlashAttention-style kernel (online softmax, float32 accumulators; Dao et al. 2022, the Triton tutorial's
forward pass) whose programs read a row's prefix keys straight from the pool, only its first ``starts[b]``
frames (rows of one voice then share the same few hundred KiB per site, in L2), then the new keys under the
chunk-causal mask of :meth:`~cosyserve.models.flow_prefix.PrefixPlan.build`. Nothing is gathered or
concatenated and no bias tensor is read.

Numerics: the same attention up to float summation order (bf16 ``P @ V`` in half precision, as the fused SDPA
kernels do; float32 inputs use IEEE float32 products, no TF32). Query frames past a row's ``new[b]`` (padding)
are computed like valid ones; a query with no allowed key (only in empty padded rows) gets zeros where SDPA
averages every key — such frames are masked by the caller.

When the kernel runs: CUDA tensors, Triton importable, fused kernels on (:func:`cosyserve.models.fused.enabled`,
``COSYSERVE_FUSED_KERNELS``), and, as for :func:`~cosyserve.models.conv_cols.causal_cols`, no other thread
owning kernel compilation or capturing a graph; otherwise :func:`prefix_attention` returns None and the caller
runs the eager ops. If the kernel fails outside a capture it is logged once and never tried again.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import fused

__all__ = ["prefix_attention"]

#: query frames x key frames per block (head_dim 64, bf16: 2 x 16 KiB of operands per program)
BLOCK_M, BLOCK_N = 64, 64


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["B", "TN", "SITE", "sq_r", "sq_h", "sq_t", "sk_r", "sk_h", "sk_t",
                                   "sv_r", "sv_h", "sv_t", "so_r", "so_h", "so_t"])
    def _attn_kernel(q_ptr, k_ptr, v_ptr, pk_ptr, pv_ptr, o_ptr, rows_ptr, start_ptr, new_ptr, stream_ptr,
                     B, TN, SITE, N_SITES, H, S, CHUNK, qk_scale,
                     sq_r, sq_h, sq_t, sk_r, sk_h, sk_t, sv_r, sv_h, sv_t, so_r, so_h, so_t,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     IEEE: tl.constexpr):
        # programs: cdiv(TN, BLOCK_M) query blocks x 2B*H (CFG row r = cfg * B + b, head h)
        pid_m = tl.program_id(0)
        rh = tl.program_id(1)
        r = rh // H
        h = rh - r * H
        b = r % B
        cfg = r // B
        start = tl.load(start_ptr + b)
        n_new = tl.load(new_ptr + b)
        streaming = tl.load(stream_ptr + b) != 0
        pool_row = tl.load(rows_ptr + b)  # slot * n_steps + step
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        m_ok = offs_m < TN
        q = tl.load(q_ptr + r.to(tl.int64) * sq_r + h * sq_h + offs_m[:, None] * sq_t + offs_d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # the prefix: keys [0, start) of pool[slot, step, SITE, cfg, h] (allowed for every query)
        pbase = (((pool_row.to(tl.int64) * N_SITES + SITE) * 2 + cfg) * H + h) * S * D
        for j0 in range(0, start, BLOCK_N):
            offs_n = j0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < start
            kv_off = pbase + offs_n[:, None] * D + offs_d[None, :]
            k = tl.load(pk_ptr + kv_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(pv_ptr + kv_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        # the new keys [0, n_new): a streaming row's query at absolute frame start + i sees those before the
        # end of its static chunk of CHUNK frames (CHUNK 0: all)
        q_abs = start + offs_m
        chunk_end = (q_abs // tl.maximum(CHUNK, 1) + 1) * CHUNK
        limit = tl.where(streaming & (CHUNK > 0), chunk_end, start + n_new)  # [BLOCK_M] absolute key bound
        for j0 in range(0, n_new, BLOCK_N):
            offs_n = j0 + tl.arange(0, BLOCK_N)
            ok = (offs_n < n_new)[None, :] & ((start + offs_n)[None, :] < limit[:, None])
            k = tl.load(k_ptr + r.to(tl.int64) * sk_r + h * sk_h + offs_n[:, None] * sk_t + offs_d[None, :],
                        mask=(offs_n < n_new)[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(ok, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + r.to(tl.int64) * sv_r + h * sv_h + offs_n[:, None] * sv_t + offs_d[None, :],
                        mask=(offs_n < n_new)[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + r.to(tl.int64) * so_r + h * so_h + offs_m[:, None] * so_t + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])

    return _attn_kernel


_KERNEL = fused.TritonKernel("prefix attention", _build_kernel)


def _launch(kernel, q: Tensor, k: Tensor, v: Tensor, pool_keys: Tensor, pool_values: Tensor, rows: Tensor,
            site: int, starts: Tensor, new: Tensor, streaming: Tensor, chunk: int) -> Tensor:
    rr, heads, t_new, d = q.shape
    b = rr // 2
    n_sites, s = pool_keys.shape[2], pool_keys.shape[5]
    for t in (q, k, v):
        if t.stride(3) != 1:
            raise ValueError("prefix attention: the head dimension must be contiguous")
    if not (pool_keys.is_contiguous() and pool_values.is_contiguous()):
        raise ValueError("prefix attention: the pool must be contiguous")
    # [2B, H, Tn, D] laid out as [2B, Tn, H, D], as the fused SDPA kernels return it (the caller's reshape is a view)
    out = torch.empty(rr, t_new, heads, d, dtype=q.dtype, device=q.device).transpose(1, 2)
    if rr == 0 or t_new == 0:
        return out
    block_d = max(16, 1 << (d - 1).bit_length())
    grid = ((t_new + BLOCK_M - 1) // BLOCK_M, rr * heads)
    kernel[grid](q, k, v, pool_keys, pool_values, out, rows, starts, new, streaming,
                 b, t_new, site, n_sites, heads, s, chunk, math.log2(math.e) / math.sqrt(d),
                 q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                 v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
                 D=d, BLOCK_D=block_d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, IEEE=q.dtype == torch.float32)
    return out


def prefix_attention(q: Tensor, k: Tensor, v: Tensor, pool_keys: Tensor, pool_values: Tensor, rows: Tensor,
                     site: int, starts: Tensor, new: Tensor, streaming: Tensor, chunk: int) -> Tensor | None:
    """Softmax attention (scale ``1/sqrt(D)``) of a prefixed solve's new frames, or None where the kernel does not
    run (module doc; the caller then runs the eager gathers and SDPA).

    ``q``, ``k``, ``v``: ``[2B, H, Tn, D]`` (CFG rows first: conditional rows ``0..B-1``, then unconditional; any
    strides with a contiguous last dimension) of the new frames; ``pool_keys``/``pool_values``: the
    :class:`~cosyserve.models.flow_prefix.PrefixPool`'s contiguous ``[slots, n_steps, n_sites, 2, H, S, D]``;
    ``rows``: int64 ``[B]``, each row's ``slot * n_steps + step``; ``site``: the attention site;
    ``starts``/``new``: int64 ``[B]``, the prefix frames read (0: none) and the valid new frames;
    ``streaming``: ``[B]`` (bool or int, nonzero: chunk-causal over static chunks of ``chunk`` frames).
    All on one CUDA device, one dtype. Returns ``[2B, H, Tn, D]`` (laid out as ``[2B, Tn, H, D]``): row ``r``'s
    query ``i`` attends to prefix keys ``j < starts[b]`` and new keys ``j < new[b]`` with, for a streaming row,
    ``starts[b] + j`` before the end of query frame ``starts[b] + i``'s chunk. No host synchronisation.
    Raises ValueError (or the kernel's error) only inside a CUDA-graph capture, where falling back is too late."""
    return _KERNEL.run(q.is_cuda, _launch, q, k, v, pool_keys, pool_values, rows, site, starts, new, streaming,
                       chunk)
