"""Fused elementwise kernels for CUDA, compiled with ``torch.compile`` (Inductor / Triton).

The graphed stages spend much of their GPU time in chains of small elementwise kernels that
each read and write a whole activation tensor (HiFT's Snake activation is five: multiply, sine,
power, multiply, add, plus the padding mask). :class:`FusedOp` wraps such a chain written in plain
torch: on CUDA (with Triton available) it runs ``torch.compile(fn, dynamic=True)`` of it, which
Inductor turns into one kernel that reads each input once and computes in float32 whatever the
storage dtype; elsewhere, or if compiling fails, it runs ``fn`` itself (eager). Only these small
functions are compiled (seconds each, shapes symbolic, so one compilation serves every CUDA-graph
bucket); whole networks were measured to compile for minutes and run slower (docs/perf.md, run 8).

Numerics: the fused kernel evaluates the same formula as ``fn`` but rounds once at the end
(eager float32 rounds after every op; eager bfloat16/float16 to the storage dtype after every op)
and uses Triton's ``sin``/``exp`` — results differ from eager by a few float32 ulps, or by less
than eager's own half-precision rounding. The GPU tests compare both.

:func:`linear_gelu` is the one fused op that is not compiled: a GEMM with cuBLASLt's GELU epilogue.

``COSYSERVE_FUSED_KERNELS=0`` (or :func:`set_enabled`) turns every fused op off (eager
everywhere), e.g. to rule them out when chasing a numerical difference.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading

import torch

from .capture import CAPTURE_LOCK

log = logging.getLogger(__name__)

_enabled = os.environ.get("COSYSERVE_FUSED_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")
_lock = threading.Lock()


def set_enabled(flag: bool) -> bool:
    """Turn fused kernels on or off for every :class:`FusedOp` (graphs captured already keep
    what they captured). Returns the previous setting."""
    global _enabled
    prev, _enabled = _enabled, bool(flag)
    return prev


#: the thread that alone compiles and runs compiled fused kernels while it captures CUDA graphs in
#: the background (:func:`compile_only_on`); None: every thread
_compile_thread: int | None = None
#: :func:`compile_only_on` value naming no thread: every thread runs fused ops eagerly
NO_THREAD = -1


def compile_only_on(thread_id: int | None) -> None:
    """While ``thread_id`` (a :class:`~cosyserve.models.graphs.BackgroundCapturer`'s thread) captures
    graphs, every other thread runs fused ops eagerly: compiling a new variant takes seconds (a stall
    for the serving thread) and its autotuning synchronises the device, which would invalidate a
    capture. The capture thread compiles each variant in its warm-ups; ``None`` ends the rule."""
    global _compile_thread
    _compile_thread = thread_id


def enabled() -> bool:
    """Whether fused kernels are on (``COSYSERVE_FUSED_KERNELS``, :func:`set_enabled`)."""
    return _enabled


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu(linear(x, weight, bias))``: ``x [..., K]``, ``weight [N, K]``, ``bias [N]`` ->
    ``[..., N]``.

    In float16/bfloat16 on CUDA (fused kernels on) the GELU runs in the GEMM's epilogue
    (``torch._addmm_activation``, cuBLASLt ``GELU_BIAS``), which saves a read and a write of the
    ``[..., N]`` activations (the flow estimator's feed-forward: 10 % of a flow solve as a separate
    kernel, docs/perf-history.md run 34). That epilogue is GELU's tanh approximation, which differs from
    the exact (erf) GELU by at most 4.7e-4 absolute (at |x| = 2.7), far below the half-precision
    rounding of the values there (bfloat16 ulp at 2-4: 1.6e-2); the GPU tests compare the result
    with float32. Everywhere else: the exact GELU after the GEMM (upstream's numerics)."""
    if _enabled and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and x.dim() >= 2:
        y = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t(), use_gelu=True)
        return y.view(*x.shape[:-1], weight.shape[0])
    return torch.nn.functional.gelu(torch.nn.functional.linear(x, weight, bias))


def _triton_available() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except Exception:  # noqa: BLE001 - a broken installation means: no Triton
        return False


def _raise_recompile_limit(limit: int = 64) -> None:
    """Dynamo keeps one compiled variant per input dtype and per static size (parameters'
    sizes are static: a Snake's channel count, a LayerNorm's width) and by default gives up
    after 8 per function; a network has a few dozen such combinations at most. (Making
    parameters' sizes symbolic too did not shorten the start-up's compiles on the H100:
    docs/perf.md "Session 23".)"""
    import torch._dynamo

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < limit:
            setattr(cfg, name, limit)


#: what dynamo raises when a compiled function runs while FX tracing is active anywhere in the process
_TRACING_RACE = "symbolically trace a dynamo-optimized function"


def _other_thread_tracing() -> bool:
    """True while FX tracing is active in the process. torch keeps that flag process-wide, so while
    one thread compiles a function (Inductor traces it), a compiled function called in another
    thread raises instead of running (seen on the H100 with graphs captured in a background thread
    while requests were served): such a call runs the eager formula instead, once, and the op is
    not marked broken."""
    import torch.fx._symbolic_trace as st  # the flag itself (is_fx_tracing() logs a warning per call)

    return bool(getattr(st, "_is_fx_tracing_flag", False))


class FusedOp:
    """A torch function of tensors that runs as one compiled kernel on CUDA, eagerly elsewhere.

    ``fn``: plain torch code (elementwise ops and per-row reductions; no host synchronisation,
    no Python branching on tensor values). Call it like ``fn``. On a CUDA first argument with
    fused kernels enabled and Triton importable, the first call compiles (``torch.compile(fn,
    dynamic=True, fullgraph=True)``, a few seconds) and later calls run the compiled kernel;
    if compiling or running the compiled code raises, a warning is logged once and this op runs
    eagerly from then on. CUDA-graph capture works as usual once a call with the same dtypes has
    run outside capture (the capture warm-ups do).

    Next to graph captures in other threads (:data:`~cosyserve.models.capture.CAPTURE_LOCK`): a
    compiled call may compile a new variant, and Inductor's autotuning then synchronises the whole
    device, which invalidates a capture under way in another thread. So a call made while another
    thread holds the capture lock runs the eager formula (same values up to float rounding, see the
    module doc), and a compiled call holds the lock (without waiting for it) so that no capture
    starts meanwhile. While a background capturer owns compiling (:func:`compile_only_on`), calls on
    other threads run the eager formula too.
    """

    def __init__(self, fn, name: str | None = None):
        self.fn = fn
        self.name = name or fn.__name__
        self._compiled = None
        self._broken = False

    def _get(self):
        if self._compiled is None:
            with _lock:
                if self._compiled is None and not self._broken:
                    if not _triton_available():
                        self._broken = True
                        log.info("fused %s: Triton is not available, running eagerly", self.name)
                    else:
                        _raise_recompile_limit()
                        self._compiled = torch.compile(self.fn, dynamic=True, fullgraph=True)
        return self._compiled

    def __call__(self, *args):
        x = args[0]
        owner = _compile_thread
        if _enabled and not self._broken and x.is_cuda and (owner is None or owner == threading.get_ident()):
            fn = self._get()
            if fn is not None:
                with CAPTURE_LOCK.try_hold() as free:
                    if not free:  # another thread may be capturing a graph: see the class doc
                        return self.fn(*args)
                    if _other_thread_tracing():  # another thread is compiling: eager this once
                        return self.fn(*args)
                    try:
                        return fn(*args)
                    except Exception as exc:  # noqa: BLE001 - fall back to the eager formula
                        if _other_thread_tracing() or _TRACING_RACE in str(exc):
                            return self.fn(*args)  # transient (see _other_thread_tracing), not broken
                        if torch.cuda.is_current_stream_capturing():
                            raise
                        self._broken = True
                        log.warning("fused %s failed (%s: %s); running it eagerly from now on",
                                    self.name, type(exc).__name__, exc)
        return self.fn(*args)

    @property
    def compiled(self) -> bool:
        """True once a compiled version exists and has not failed."""
        return self._compiled is not None and not self._broken


class TritonKernel:
    """A hand-written Triton kernel (``build()`` imports Triton and returns the ``@triton.jit`` function),
    built on first use, with the rules under which :class:`FusedOp` runs its compiled kernels:
    :meth:`run` launches it only on CUDA inputs, with fused kernels on (:func:`enabled`), on the thread that
    owns kernel compilation while a background capture runs (:func:`compile_only_on`; a first launch of a
    variant compiles and loads it) and while no other thread captures a CUDA graph
    (:data:`~cosyserve.models.capture.CAPTURE_LOCK`); otherwise, or if Triton is missing, the caller runs
    its eager formula. A launch that fails outside a capture is logged once and the kernel is not tried
    again (inside a capture the error propagates: falling back there is too late). ``name``: for the logs.
    Used by :func:`~cosyserve.models.conv_cols.causal_cols` and
    :func:`~cosyserve.models.prefix_attention.prefix_attention`."""

    def __init__(self, name: str, build):
        self.name, self._build = name, build
        self._kernel = None  # None: not built yet; False: unavailable or broken
        self._lock = threading.Lock()

    def get(self):
        """The built kernel, or None (no working Triton, or disabled after a failure)."""
        if self._kernel is None:
            with self._lock:
                if self._kernel is None:
                    try:
                        self._kernel = self._build()
                    except Exception as exc:  # noqa: BLE001 - no (working) Triton: the eager ops
                        log.info("%s: no Triton kernel (%s: %s), running eagerly", self.name, type(exc).__name__,
                                 exc)
                        self._kernel = False
        return self._kernel or None

    def run(self, cuda: bool, launch, *args):
        """``launch(kernel, *args)``'s result where the kernel may run now (``cuda``: the inputs are on a
        CUDA device), else None (the caller's eager formula then runs; ``launch`` must not return None)."""
        owner = _compile_thread
        if not (_enabled and cuda and self._kernel is not False and (owner is None or owner == threading.get_ident())):
            return None
        kernel = self.get()
        if kernel is None:
            return None
        with CAPTURE_LOCK.try_hold() as free:
            if not free:
                return None
            try:
                return launch(kernel, *args)
            except Exception as exc:  # noqa: BLE001 - fall back to the eager ops
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise
                self._kernel = False
                log.warning("%s: the Triton kernel failed (%s: %s); running eagerly from now on", self.name,
                            type(exc).__name__, exc)
                return None


def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu(linear(x, weight, bias), approximate="tanh")``: ``x [..., K]``, ``weight [N, K]``,
    ``bias [N]`` -> ``[..., N]`` (the feed-forward of both DiT estimators, whose upstream GELU is the
    tanh approximation). In float16/bfloat16 on CUDA (fused kernels on) the GELU runs in cuBLASLt's
    GEMM epilogue: the same formula, no extra kernel and no extra read/write of the activations."""
    if _enabled and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
        y = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t(), use_gelu=True)
        return y.view(*x.shape[:-1], weight.shape[0])
    return torch.nn.functional.gelu(torch.nn.functional.linear(x, weight, bias), approximate="tanh")


def _norm_modulate_eager(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(shift, torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=1e-6), scale + 1)


#: adaLN modulation ``layer_norm(x, eps=1e-6, no affine) * (1 + scale) + shift`` over the last dim of
#: ``x [N, T, C]`` with ``shift``/``scale`` broadcastable to it (``[N or 1, 1, C]``): one kernel on
#: CUDA (both DiT estimators: DiT-family adaLN-Zero blocks, upstream ``modulate``)
norm_modulate = FusedOp(_norm_modulate_eager, "dit_norm_modulate")


def _add_norm_modulate_eager(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, shift: torch.Tensor,
                             scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.addcmul(x, gate, y)
    return x, _norm_modulate_eager(x, shift, scale)


#: a gated residual branch and the next adaLN modulation: ``x + gate * y`` ``[N, T, C]`` and
#: :data:`norm_modulate` of it, as one kernel on CUDA (the Step-Audio2 DiT block's residual joins)
add_norm_modulate = FusedOp(_add_norm_modulate_eager, "dit_add_norm_modulate")


def attention_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask (0 where ``allowed`` ``[..., Q, K]`` bool is True, -inf elsewhere) in
    ``dtype``, its rows padded in memory to a multiple of 8 elements: the memory-efficient attention
    kernel then reads it as it is, where a boolean mask is converted (and padded) in every call —
    three kernels per attention layer and Euler step that a solve saves by building this once (the
    CosyVoice3 and Step-Audio2 DiTs). Not compiled: two kernels (fill, masked fill)."""
    k = allowed.shape[-1]
    bias = torch.zeros(*allowed.shape[:-1], -(-k // 8) * 8, dtype=dtype, device=allowed.device)
    return bias[..., :k].masked_fill_(~allowed, float("-inf"))
