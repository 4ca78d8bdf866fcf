"""The causal convolution's GEMM columns and new cache (cosyserve.models.conv_cols).

CPU: the eager formula is the causal convolution (``conv1d`` over ``cache ++ x``) and its new cache is the
frames ``last_idx`` names; the DiT block writes both halves of its new conv cache where it is told.
GPU (skipped on CPU): the Triton kernel equals the eager formula bitwise, for several shapes, strides and
dtypes, with and without ``last_idx`` and ``new_out``, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from cosyserve.models import conv_cols
from cosyserve.models.conv_cols import causal_cols, causal_cols_eager


def _case(n, t, c, k, dtype, cache_dtype, with_idx, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, t, c, generator=g).to(device=device, dtype=dtype)
    # a strided cache (every second channel of a wider tensor), as the split halves of a block's cache are
    cache = torch.randn(n, 2 * c, k - 1, generator=g).to(device=device, dtype=cache_dtype)[:, ::2]
    idx = None
    if with_idx:
        idx = torch.stack([torch.randint(0, k - 1 + t, (k - 1,), generator=g) for _ in range(n)]).to(device)
    return x, cache, idx


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("t", [1, 2, 7])
def test_eager_columns_are_the_causal_convolution(k, t):
    n, c, co = 3, 5, 4
    x, cache, _ = _case(n, t, c, k, torch.float64, torch.float64, False)
    w = torch.randn(co, c, k, dtype=torch.float64)
    cols, new = causal_cols_eager(x, cache, None)
    assert cols.shape == (n, t, c * k) and cols.is_contiguous()
    xx = torch.cat([cache, x.transpose(1, 2)], dim=2)  # [N, C, k-1+T]
    want = F.conv1d(xx, w).transpose(1, 2)  # [N, T, C_out]
    torch.testing.assert_close(cols @ w.reshape(co, -1).t(), want, rtol=0, atol=1e-12)
    assert torch.equal(new, xx[:, :, -(k - 1):])  # no last_idx: the last k-1 frames


def test_eager_new_cache_takes_the_named_frames_and_writes_new_out():
    n, t, c, k = 3, 6, 5, 3
    x, cache, idx = _case(n, t, c, k, torch.float32, torch.float32, True)
    xx = torch.cat([cache, x.transpose(1, 2)], dim=2)
    want = torch.stack([xx[b][:, idx[b]] for b in range(n)])
    _, new = causal_cols_eager(x, cache, idx)
    assert torch.equal(new, want)
    out = torch.full((n, 2 * c, k - 1), float("nan"))
    _, new2 = causal_cols_eager(x, cache, idx, out[:, c:])
    assert new2.data_ptr() == out[:, c:].data_ptr() and torch.equal(out[:, c:], want)
    assert out[:, :c].isnan().all()  # nothing else written


def test_cpu_runs_the_eager_formula():
    x, cache, idx = _case(2, 4, 6, 3, torch.float32, torch.bfloat16, True)
    for a, b in zip(causal_cols(x, cache, idx), causal_cols_eager(x, cache, idx)):
        assert torch.equal(a, b)


def test_conv_block_writes_both_halves_of_its_new_cache():
    from cosyserve.models.dit_flow import _CausalConvBlock

    torch.manual_seed(0)
    n, t, c, k = 2, 5, 8, 3
    blk = _CausalConvBlock(c, k)
    x = torch.randn(n, t, c)
    cache = torch.randn(n, 2 * c, k - 1)
    h, new = blk(x, cache, None)
    out = torch.full((n, 2 * c, k - 1), float("nan"))
    h2, new2 = blk(x, cache, None, out)
    assert new2 is out and torch.equal(new, out) and torch.equal(h, h2)
    # the first half is the last k-1 input frames of the first convolution
    assert torch.equal(new[:, :c], torch.cat([cache[:, :c], x.transpose(1, 2)], dim=2)[:, :, -(k - 1):])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_kernel_equals_eager_bitwise():
    if conv_cols._get_kernel() is None:
        pytest.skip("no Triton")
    shapes = [(1, 1, 7), (3, 2, 130), (8, 50, 512), (4, 803, 512)]
    for (n, t, c), k, (dt, cdt), with_idx, with_out in itertools.product(
            shapes, [2, 3], [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                             (torch.bfloat16, torch.float32)], [False, True], [False, True]):
        x, cache, idx = _case(n, t, c, k, dt, cdt, with_idx, "cuda")
        out = torch.full((n, 2 * c, k - 1), float("nan"), dtype=dt, device="cuda")[:, c:] if with_out else None
        ref_cols, ref_new = causal_cols_eager(x, cache, idx)
        cols, new = conv_cols._launch(conv_cols._get_kernel(), x, cache, idx, out)
        key = (n, t, c, k, dt, cdt, with_idx, with_out)
        assert torch.equal(cols, ref_cols), key
        assert torch.equal(new, ref_new), key
        if with_out:
            assert new.data_ptr() == out.data_ptr(), key
    # a new_out of another dtype than x's: cast on the way, as the eager formula's copy casts
    x, cache, idx = _case(3, 9, 130, 3, torch.bfloat16, torch.bfloat16, True, "cuda")
    out = torch.empty(3, 130, 2, device="cuda")
    cols, new = conv_cols._launch(conv_cols._get_kernel(), x, cache, idx, out)
    ref_cols, ref_new = causal_cols_eager(x, cache, idx, torch.empty(3, 130, 2, device="cuda"))
    assert new is out and torch.equal(cols, ref_cols) and torch.equal(out, ref_new)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_kernel_replays_from_a_cuda_graph():
    if conv_cols._get_kernel() is None:
        pytest.skip("no Triton")
    n, t, c, k = 6, 40, 256, 3
    x, cache, idx = _case(n, t, c, k, torch.bfloat16, torch.bfloat16, True, "cuda")
    out = torch.empty(n, c, k - 1, dtype=torch.bfloat16, device="cuda")
    causal_cols(x, cache, idx, out)  # compiles outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cols, _ = causal_cols(x, cache, idx, out)
    x2, cache2, idx2 = _case(n, t, c, k, torch.bfloat16, torch.bfloat16, True, "cuda", seed=1)
    x.copy_(x2)
    cache.copy_(cache2)
    idx.copy_(idx2)
    g.replay()
    ref_cols, ref_new = causal_cols_eager(x2, cache2, idx2)
    assert torch.equal(cols, ref_cols) and torch.equal(out, ref_new)
