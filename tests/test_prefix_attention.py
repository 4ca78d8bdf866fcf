"""Issue 17 (UNet path): the pool-reading attention kernel of prefixed flow solves
(:mod:`cosyserve.models.prefix_attention`) against the eager gathers + SDPA with the plan's bias
(:meth:`cosyserve.models.flow_prefix.PrefixStepIO.keys_values`).

Batches mix rows with and without a prefix, prefixes of different lengths in different slots, Euler steps
and sites, streaming (chunk-causal) and final rows, padded query frames and an empty row. On CUDA the kernel
runs as the server runs it (GPU tests); on CPU, where Triton is installed (it is not a dependency), its
interpreter runs the same kernel source.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from cosyserve.models import prefix_attention as pa
from cosyserve.models.flow_prefix import PrefixPlan, PrefixPool

HEADS, HEAD_DIM, SITES, STEPS, CHUNK = 2, 64, 3, 4, 25


def _case(device, dtype, seed: int = 0, max_frames: int = 150, t_new: int = 90):
    """A pool of three slots (prefixes of 150 / 75 / 0 frames) and a plan of six rows: every row's
    (slot, start, new, streaming) as the flow builds them, the new frames' q/k/v laid out as the U-Net's
    one qkv GEMM leaves them (strided views)."""
    g = torch.Generator().manual_seed(seed)
    pool = PrefixPool(3, max_frames, STEPS, SITES, HEADS, HEAD_DIM, 8, device, dtype)
    for slot, frames in ((0, 150), (1, 75)):
        for store in (pool.keys, pool.values):
            store[slot, ..., :frames, :] = torch.randn(store[slot, ..., :frames, :].shape, generator=g).to(device,
                                                                                                          dtype)
        pool.frames[slot] = frames
    slots = torch.tensor([0, 1, 0, 2, 1, 0], device=device)
    starts = torch.tensor([150, 75, 150, 0, 75, 0], device=device)
    new = torch.tensor([54, 90, 17, 90, 40, 0], device=device)  # row 5: an empty (padded) row
    streaming = torch.tensor([True, True, False, True, False, True], device=device)
    plan = PrefixPlan.build(pool, slots, starts, new, streaming, t_new, CHUNK, dtype)
    b = slots.numel()
    qkv = torch.randn(2 * b, t_new, 3, HEADS, HEAD_DIM, generator=g).to(device, dtype)
    q, k, v = qkv.unbind(2)
    return pool, plan, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _eager(plan, step: int, site: int, q, k, v):
    io = plan.step_io()
    io._rows = plan.base + step
    io._site = site
    kk, vv = io.keys_values(k, v)
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=plan.bias)


def _compare(launch, device, dtype, tol):
    for seed, (step, site) in enumerate([(0, 0), (3, 2), (1, 1)]):
        pool, plan, q, k, v = _case(device, dtype, seed)
        want = _eager(plan, step, site, q, k, v).float()
        got = launch(q, k, v, pool.keys, pool.values, plan.base + step, site, plan.row_start, plan.row_new,
                     plan.row_streaming, plan.chunk)
        assert got.shape == want.shape and got.transpose(1, 2).is_contiguous()  # [2B, Tn, H, D] storage
        got = got.float()
        assert torch.isfinite(got).all()
        valid = torch.arange(q.size(2), device=device).view(1, 1, -1, 1) < torch.cat([plan.row_new] * 2).view(
            -1, 1, 1, 1)
        err = ((got - want) * valid).norm() / (want * valid).norm()
        assert err <= tol, (seed, float(err))
        # padded query frames of non-empty rows are computed like valid ones (the caller masks them)
        live = torch.cat([plan.row_new] * 2) > 0
        assert ((got - want)[live].norm() / want[live].norm()) <= tol


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed (not a dependency)")
def test_kernel_in_the_triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel = pa._build_kernel()
    _compare(lambda *a: pa._launch(kernel, *a), "cpu", torch.float32, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_cuda(dtype):
    out = []

    def launch(*a):
        got = pa.prefix_attention(*a)
        assert got is not None, "the kernel did not run"
        out.append(got)
        return got

    _compare(launch, "cuda", dtype, 1e-5 if dtype == torch.float32 else 1e-2)
    # replayed from a CUDA graph: reads the step's pool rows and the plan's tensors as they are at replay
    pool, plan, q, k, v = _case("cuda", dtype, 7)
    rows = plan.base.clone()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        pa.prefix_attention(q, k, v, pool.keys, pool.values, rows, 1, plan.row_start, plan.row_new,
                            plan.row_streaming, plan.chunk)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = pa.prefix_attention(q, k, v, pool.keys, pool.values, rows, 1, plan.row_start, plan.row_new,
                                  plan.row_streaming, plan.chunk)
    rows.add_(2)
    graph.replay()
    want = _eager(plan, 2, 1, q, k, v)
    live = (torch.arange(q.size(2), device="cuda").view(1, 1, -1, 1)
            < torch.cat([plan.row_new] * 2).view(-1, 1, 1, 1))
    err = ((res.float() - want.float()) * live).norm() / (want.float() * live).norm()
    assert err <= (1e-5 if dtype == torch.float32 else 1e-2)


def test_no_kernel_off_cuda():
    pool, plan, q, k, v = _case("cpu", torch.float32)
    args = (q, k, v, pool.keys, pool.values, plan.base, 0, plan.row_start, plan.row_new, plan.row_streaming,
            plan.chunk)
    assert pa.prefix_attention(*args) is None  # CPU tensors: the caller's eager ops
    # the step IO then runs the eager gathers + SDPA, and advances its site either way
    io = plan.step_io()
    out = io.attention(q, k, v, plan.bias)
    assert io._site == 1 and torch.equal(out, _eager(plan, 0, 0, q, k, v))


def test_triton_kernel_gate():
    """:class:`cosyserve.models.fused.TritonKernel`, which both hand-written kernels run through: built once on
    first use; launched only on CUDA inputs with fused kernels on and on the thread that owns compilation; a
    failed launch (outside a capture) disables it, and a build that fails means: never (eager ops instead)."""
    from cosyserve.models import fused

    builds, calls = [], []

    def build():
        builds.append(1)
        return "kernel"

    def launch(kernel, x):
        calls.append((kernel, x))
        if x == "bad":
            raise RuntimeError("launch failed")
        return x * 2

    k = fused.TritonKernel("test kernel", build)
    assert k.run(False, launch, 3) is None and builds == []  # not CUDA: not even built
    assert k.run(True, launch, 3) == 6 and k.run(True, launch, 4) == 8 and builds == [1]
    prev = fused.set_enabled(False)
    try:
        assert k.run(True, launch, 5) is None  # COSYSERVE_FUSED_KERNELS=0
    finally:
        fused.set_enabled(prev)
    fused.compile_only_on(fused.NO_THREAD)  # a background capture owns compilation: nobody else launches
    try:
        assert k.run(True, launch, 5) is None
    finally:
        fused.compile_only_on(None)
    assert k.run(True, launch, "bad") is None  # failed: the caller's eager ops, and from now on
    assert k.run(True, launch, 6) is None and calls[-1] == ("kernel", "bad") and k.get() is None

    def broken():
        raise ImportError("no triton")

    nb = fused.TritonKernel("test kernel", broken)
    assert nb.run(True, launch, 1) is None and nb.get() is None
