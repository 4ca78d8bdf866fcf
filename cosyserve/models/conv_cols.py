"""The input columns of a causal convolution computed as one GEMM, and its new cache: one Triton kernel on CUDA.

A causal convolution of kernel ``k`` over time-major ``x [N, T, C]`` whose previous ``k - 1`` input frames
are ``cache [N, C, k-1]`` is one GEMM over the columns ``cols[n, t, c*k + j] = (cache ++ x)[n, t + j, c]``
(channel-major, like ``conv.weight.reshape(C_out, C*k)``), and the stream's next cache is ``k - 1`` frames
of ``cache ++ x`` (per row the last valid ones). Eagerly that is a concatenation (a copy of ``x``), the
unfolding copy (PyTorch's generic strided copy kernel) and a gather: on an H100 at the DiT estimator's
offline shape (8 rows x 800 frames x 512 channels, bf16) 12.7 + 22.6 + 4.3 us per convolution, 320
convolutions per solve: 19 % of a 4-utterance offline solve (``benchmarks/t2w_profile.py --solve-kernels 4
--offline-tokens 250``, docs/perf.md "Session 33"). An Inductor kernel of the same formula was slower still
(dynamic shapes: 25 us at 24 rows x 50 frames, "Session 32"). :func:`causal_cols` writes both outputs with
one kernel (18-19 us at that shape) that writes each column element once, in order; results are bitwise
those of :func:`causal_cols_eager` (pure copies; a cache of another dtype is cast to ``x``'s with
``Tensor.to``, as the eager formula casts it).

When the kernel runs: CUDA tensors, Triton importable, fused kernels on (:func:`cosyserve.models.fused.enabled`,
``COSYSERVE_FUSED_KERNELS``), and no other thread capturing a CUDA graph (the first launch of a kernel variant
compiles and loads it; like :class:`~cosyserve.models.fused.FusedOp`, a call made while another thread holds
:data:`~cosyserve.models.capture.CAPTURE_LOCK` or while a background capturer owns compiling runs the eager ops).
Otherwise :func:`causal_cols_eager`. If the kernel fails outside a capture it is logged once and the eager ops
run from then on.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import fused

__all__ = ["causal_cols", "causal_cols_eager"]


def causal_cols_eager(x: Tensor, cache: Tensor, last_idx: Tensor | None,
                      new_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The reference formula of :func:`causal_cols` in plain torch ops (any device)."""
    k = cache.shape[2] + 1
    n, t, c = x.shape
    xx = torch.cat([cache.transpose(1, 2).to(x.dtype), x], dim=1)  # [N, k-1+T, C]
    cols = xx.unfold(1, k, 1).reshape(n, t, c * k)
    new = xx[:, t:] if last_idx is None else torch.gather(xx, 1, last_idx.unsqueeze(-1).expand(-1, -1, c))
    new = new.transpose(1, 2)
    if new_out is not None:
        new_out.copy_(new)
        new = new_out
    return cols, new


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T", "sx_n", "sx_t", "sc_n", "sc_c", "sc_k", "sn_n", "sn_c", "sn_k", "si_n"])
    def _cols_kernel(x_ptr, cache_ptr, cols_ptr, new_ptr, idx_ptr, N, T, C,
                     sx_n, sx_t, sc_n, sc_c, sc_k, sn_n, sn_c, sn_k, si_n,
                     K: tl.constexpr, KP: tl.constexpr, HAS_IDX: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        # programs [0, N * cdiv(T, BLOCK_T)) x cdiv(C * K, BLOCK_C): BLOCK_T frames x BLOCK_C consecutive
        # column elements each (written in order: coalesced stores; the loads gather from K frames);
        # programs [N * cdiv(T, BLOCK_T), + N) x cdiv(C, BLOCK_C): row n's new cache (BLOCK_C channels)
        pid = tl.program_id(0)
        n_tb = tl.cdiv(T, BLOCK_T)
        if pid < N * n_tb:
            n = pid // n_tb
            t = (pid % n_tb) * BLOCK_T + tl.arange(0, BLOCK_T)
            o = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # column element c * K + j
            cc = o // K
            s = t[:, None] + (o - cc * K)[None, :] - (K - 1)  # frame of x (negative: of the cache)
            ok = (t[:, None] < T) & (o < C * K)[None, :]
            in_x = ok & (s >= 0)
            vx = tl.load(x_ptr + n * sx_n + s * sx_t + cc[None, :], mask=in_x, other=0.0)
            vc = tl.load(cache_ptr + n * sc_n + cc[None, :] * sc_c + (s + K - 1) * sc_k, mask=ok & (s < 0),
                         other=0.0)
            tl.store(cols_ptr + (n * T + t[:, None]) * (C * K) + o[None, :], tl.where(in_x, vx, vc), mask=ok)
        else:  # (names of their own: Triton types a name alike in both branches)
            row = pid - N * n_tb
            c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
            i = tl.arange(0, KP)
            if HAS_IDX:
                f = tl.load(idx_ptr + row * si_n + i, mask=i < K - 1, other=0)  # frame of cache ++ x
            else:
                f = T + i
            keep = (i[:, None] < K - 1) & (c[None, :] < C)
            fx = f[:, None] - (K - 1)
            wx = tl.load(x_ptr + row * sx_n + fx * sx_t + c[None, :], mask=keep & (fx >= 0), other=0.0)
            wc = tl.load(cache_ptr + row * sc_n + c[None, :] * sc_c + f[:, None] * sc_k, mask=keep & (fx < 0),
                         other=0.0)
            tl.store(new_ptr + row * sn_n + c[None, :] * sn_c + i[:, None] * sn_k, tl.where(fx >= 0, wx, wc),
                     mask=keep)

    return _cols_kernel


_KERNEL = fused.TritonKernel("causal conv columns", _build_kernel)


def _get_kernel():
    """The Triton kernel, or None (no working Triton)."""
    return _KERNEL.get()


#: the kernel's tile: frames x consecutive column elements per program (H100: 18-19 µs per call at 8 rows x
#: 800 frames x 512 channels; ``benchmarks/dit_copy_probe.py --tiles`` times others)
BLOCK_T, BLOCK_C = 4, 512


def _launch(kernel, x: Tensor, cache: Tensor, last_idx: Tensor | None, new_out: Tensor | None,
            block_t: int = BLOCK_T, block_c: int = BLOCK_C):
    n, t, c = x.shape
    k = cache.shape[2] + 1
    if x.stride(2) != 1:
        x = x.contiguous()
    if cache.dtype != x.dtype:  # (a few frames) cast as the eager formula casts
        cache = cache.to(x.dtype)
    cols = torch.empty(n, t, c * k, dtype=x.dtype, device=x.device)
    # the new cache as eager returns it: a [N, C, k-1] view of [N, k-1, C] storage, or the caller's tensor
    direct = new_out is not None and new_out.dtype == x.dtype
    new = new_out if direct else torch.empty(n, k - 1, c, dtype=x.dtype, device=x.device).transpose(1, 2)
    idx = last_idx if last_idx is not None else cols  # (any tensor: not read without HAS_IDX)
    grid = (n * ((t + block_t - 1) // block_t) + n, (c * k + block_c - 1) // block_c)
    kernel[grid](x, cache, cols, new, idx, n, t, c,
                 x.stride(0), x.stride(1), cache.stride(0), cache.stride(1), cache.stride(2),
                 new.stride(0), new.stride(1), new.stride(2), idx.stride(0) if last_idx is not None else 0,
                 K=k, KP=max(4, 1 << (k - 1).bit_length()), HAS_IDX=last_idx is not None,
                 BLOCK_T=block_t, BLOCK_C=block_c)
    if new_out is not None and not direct:  # another dtype: cast on the copy, as the eager formula does
        new = new_out.copy_(new)
    return cols, new


def causal_cols(x: Tensor, cache: Tensor, last_idx: Tensor | None,
                new_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Columns and new cache of a causal convolution of kernel ``k`` computed as one GEMM.

    ``x [N, T, C]`` (time-major, any dtype), ``cache [N, C, k-1]`` (the ``k - 1`` input frames before
    ``x``'s first; any strides, cast to ``x``'s dtype), ``last_idx [N, k-1]`` int64 or None: per row, the
    frames of ``cache ++ x`` (0 .. k-2: the cache's, then ``x``'s) that become the new cache, None: the
    last ``k - 1``. ``new_out``: a ``[N, C, k-1]`` tensor (any strides; another dtype than ``x``'s costs one
    more copy) the new cache is written into. Returns ``(cols [N, T, C*k]`` contiguous,
    ``cols[n, t, c*k + j] = (cache ++ x)[n, t + j, c]``; the new cache ``[N, C, k-1]``: ``new_out``, else a
    view of fresh ``[N, k-1, C]`` storage)``.
    Bitwise equal to :func:`causal_cols_eager`; see the module doc for when the Triton kernel runs."""
    out = _KERNEL.run(x.is_cuda, _launch, x, cache, last_idx, new_out)
    return out if out is not None else causal_cols_eager(x, cache, last_idx, new_out)
