"""Voice prompt prefixes for the CosyVoice2 flow's streaming calls, in fixed-shape device tensors (issue 17).

Every non-final streaming call of a stream re-runs the flow over the prompt and all tokens so far. Its
first frames — the prompt's complete static chunks, :meth:`~cosyserve.models.flow.FlowModel.
prompt_prefix_frames` (150 of the benchmark voice's 204 first-call frames) — depend on the voice alone
(noise indexed by frame, ``mu`` of chunk-causal encoder chunks inside the prompt, ``cond``, ``spks``, ``t``):
the Euler steps' attention keys/values and causal-convolution contexts of those frames are the same for
every stream of the voice and every streaming call (docs/architecture.md, "Flow stream cache"). A
*prefixed* solve reads them instead of computing them and runs the estimator on the frames after the
prefix only: per request of the benchmark (four flow calls of 204, 254, 354, 412 frames) the first three
solve 54, 104 and 204 frames, and no per-stream state is kept (the eager stream cache,
:class:`~cosyserve.models.flow.FlowStreamCache`, also keeps each stream's own chunks; it is eager and
host-bound, docs/perf.md "Session 34").

Unlike the eager stream cache, everything here has shapes fixed by the batch's bucket, and every
per-row choice is data (index tensors), so that a solve can be captured in CUDA graphs:

* :class:`PrefixPool`: ``slots`` prefixes of at most ``max_frames`` frames, zero-initialised device
  tensors (a slot's frames past its prefix stay zero; masked keys must not hold NaN/inf, which a zero
  attention weight would still spread);
* :class:`PrefixPlan`: the masks of a batch whose row ``b`` solves frames ``[starts[b], starts[b] +
  new[b])`` after the prefix in pool slot ``slots[b]`` (``starts[b] = 0``: no prefix; keys of the
  prefix part masked, causal-convolution contexts zero — the uncached solve); the attention bias is
  ``[2B, 1, Tn, S + Tn]`` with ``S`` = the pool's ``max_frames`` whatever the prefixes' lengths;
* :class:`PrefixStepIO`: an Euler step's reads (the interface of
  :class:`~cosyserve.models.flow_estimator.StreamStepIO`, :meth:`~cosyserve.models.flow_estimator.
  FlowEstimator.forward_btc` dispatches on the plan): per attention site one gather of the rows'
  prefix keys/values at the step (a device counter the step advances, so one captured step can be
  replayed ``n`` times), per convolution the rows' contexts.

Algorithm source: CosyVoice's streaming flow (``CausalMaskedDiffWithXvec.inference`` with
``streaming=True``, ``CausalConditionalCFM``); the exactness argument is the stream cache's. Numerics:
equal to the uncached solve up to float summation order (tests/test_flow_prefix.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .flow_estimator import _MASK_BIAS, CausalConv1d, EstimatorStreamCache
from .prefix_attention import prefix_attention

__all__ = ["PrefixPool", "PrefixPlan", "PrefixStepIO", "context_width"]


def context_width(estimator) -> int:
    """``W``: the values per CFG row of one Euler step's causal-convolution contexts (every
    :class:`~cosyserve.models.flow_estimator.CausalConv1d` of a one-level U-Net reads ``kernel - 1``
    frames of its ``C_in`` input channels before the first new frame, once per step), as
    :attr:`EstimatorStreamCache.contexts` holds them."""
    return sum((m.kernel_size[0] - 1) * m.in_channels for m in estimator.modules() if isinstance(m, CausalConv1d))


class PrefixPool:
    """Fixed device storage for ``slots`` voice prompt prefixes of the estimator (module doc).

    Tensors (model dtype, model device, zero-initialised; never reallocated, so CUDA graphs may read them):
        keys, values: ``[slots, n_steps, n_sites, 2, heads, max_frames, head_dim]``: per slot, Euler step,
            attention site (U-Net order) and CFG row (0 conditional, 1 unconditional), the prefix's keys and
            values, zero past the slot's :attr:`frames`;
        contexts: ``[slots, n_steps, 2, W]`` (:func:`context_width`): every causal convolution's input at
            the ``kernel - 1`` frames before the prefix's end.

    ``frames[slot]``: the prefix frames a slot holds (0: empty). Memory: ``slots * max_frames * n_steps *
    FlowEstimator.stream_cache_values_per_frame()`` values of the model dtype (CosyVoice2 full size in
    bfloat16: 2.19 MiB per frame for 10 steps, 0.64 GiB per slot of 300 frames). Raises ValueError for
    non-positive sizes.
    """

    def __init__(self, slots: int, max_frames: int, n_steps: int, n_sites: int, heads: int, head_dim: int,
                 width: int, device, dtype: torch.dtype):
        if min(slots, max_frames, n_steps, n_sites, heads, head_dim) < 1 or width < 0:
            raise ValueError("PrefixPool needs positive slots, max_frames, n_steps, n_sites, heads and head_dim")
        shape = (slots, n_steps, n_sites, 2, heads, max_frames, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.contexts = torch.zeros(slots, n_steps, 2, width, device=device, dtype=dtype)
        self.slots, self.max_frames, self.n_steps, self.n_sites = slots, max_frames, n_steps, n_sites
        self.frames = [0] * slots

    @classmethod
    def for_flow(cls, flow, slots: int, max_frames: int) -> "PrefixPool":
        """A pool shaped for ``flow``'s (a :class:`~cosyserve.models.flow.FlowModel`) estimator, default
        step count, dtype and device. Raises ValueError unless its estimator supports stream caches."""
        est = flow.decoder.estimator
        if not flow.supports_stream_cache:
            raise ValueError("prompt prefixes need a one-level U-Net estimator (CosyVoice2)")
        return cls(slots, max_frames, flow.cfg.cfm.n_timesteps, est.attention_sites(), est.cfg.num_heads,
                   est.cfg.attention_head_dim, context_width(est), flow._model_device(), flow._model_dtype())

    def nbytes(self) -> int:
        """Bytes of device memory held."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.contexts))

    def put(self, slot: int, cache: EstimatorStreamCache) -> None:
        """Copy a prefix (an :class:`EstimatorStreamCache` holding exactly the prompt's complete chunks,
        built by a streaming call whose commit was limited to them) into ``slot``, replacing what it held.
        Raises ValueError for a slot out of range, an empty cache, more frames than ``max_frames``, or
        another step count or shape."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"prefix pool: slot {slot} out of range (0..{self.slots - 1})")
        s = cache.frames
        if s <= 0 or cache.keys is None or cache.contexts is None:
            raise ValueError("prefix pool: an empty prefix")
        if s > self.max_frames:
            raise ValueError(f"prefix pool: a prefix of {s} frames exceeds the pool's {self.max_frames}")
        if cache.keys.shape[:2] != self.keys.shape[1:3] or cache.contexts.shape[-1] != self.contexts.shape[-1]:
            raise ValueError(f"prefix pool: a prefix of shape {tuple(cache.keys.shape)} / contexts "
                             f"{tuple(cache.contexts.shape)} does not fit the pool's {tuple(self.keys.shape[1:])}")
        for dst, src in ((self.keys, cache.keys), (self.values, cache.values)):
            dst[slot].zero_()
            dst[slot, ..., :s, :].copy_(src)
        self.contexts[slot].copy_(cache.contexts)
        self.frames[slot] = s

    def clear(self, slot: int) -> None:
        """Empty ``slot`` (zeros again)."""
        self.keys[slot].zero_()
        self.values[slot].zero_()
        self.contexts[slot].zero_()
        self.frames[slot] = 0


@dataclass
class PrefixPlan:
    """Masks and prefix reads of one prefixed solve (module doc), in place of an
    :class:`~cosyserve.models.flow_estimator.AttentionPlan`; build it with :meth:`build`.

    Fields: ``pool`` (the :class:`PrefixPool`), ``b`` (rows), ``t_new`` (frames per row), and the tensors
    ``bias [2B, 1, Tn, S + Tn]`` (0 allowed, the most negative finite value masked), ``mask [2B, Tn, 1]`` (1 at
    valid frames), ``has_prefix [B, 1, 1]`` (model dtype), ``base [B]`` (each row's first index into the
    pool's flattened (slot, step) rows) and ``step`` (0-dim int64: Euler steps done, advanced by
    :meth:`PrefixStepIO.finish`), and for the attention kernel the rows' ``row_start``, ``row_new`` (int64
    ``[B]``, :meth:`build`'s ``starts`` and ``new``), ``row_streaming`` (int64 ``[B]``, 1: chunk-causal) and
    ``chunk`` (frames per static chunk). A dataclass, so that CUDA graphs can keep its tensors in shared
    buffers (:func:`~cosyserve.models.graphs._share_plan`)."""

    pool: PrefixPool
    b: int
    t_new: int
    bias: Tensor
    mask: Tensor
    has_prefix: Tensor
    base: Tensor
    step: Tensor
    row_start: Tensor
    row_new: Tensor
    row_streaming: Tensor
    chunk: int

    @classmethod
    def build(cls, pool: PrefixPool, slots: Tensor, starts: Tensor, new: Tensor, streaming: Tensor, t_new: int,
              chunk: int, dtype: torch.dtype) -> "PrefixPlan":
        """``slots``, ``starts``, ``new``: int64 ``[B]``; ``streaming``: bool ``[B]`` (all on the pool's
        device): row ``b`` holds frames ``[starts[b], starts[b] + new[b])`` of its item left-aligned in
        ``t_new`` frames, after the prefix of pool slot ``slots[b]`` when ``starts[b] > 0`` (``starts[b]``
        must then be that slot's frames; with 0 the slot's keys are masked and its contexts zeroed). Prefix
        key ``j`` is allowed iff ``j < starts[b]``; new key ``j`` iff ``j < new[b]`` and, for a streaming row,
        frame ``starts[b] + j`` lies before the end of the query's static chunk of ``chunk`` frames. No host
        synchronisation."""
        device = starts.device
        t_new = int(t_new)
        start, n_new = starts.view(-1, 1), new.view(-1, 1)
        i = torch.arange(t_new, device=device).view(1, -1)
        q_abs = start + i                                                      # [B, Tn] absolute frames
        prefix_ok = torch.arange(pool.max_frames, device=device).view(1, -1) < start  # [B, S]
        k_ok = i < n_new                                                       # [B, Tn]
        if chunk > 0:
            chunk_end = (torch.div(q_abs, chunk, rounding_mode="floor") + 1) * chunk
            causal = q_abs.unsqueeze(1) < chunk_end.unsqueeze(2)               # [B, Tn(q), Tn(k)]
            new_ok = k_ok.unsqueeze(1) & (causal | ~streaming.view(-1, 1, 1))
        else:
            new_ok = k_ok.unsqueeze(1).expand(-1, t_new, -1)
        allowed = torch.cat([prefix_ok.unsqueeze(1).expand(-1, t_new, -1), new_ok], dim=2)
        masked_value = max(_MASK_BIAS, torch.finfo(dtype).min)
        bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, masked_value)
        valid = k_ok.to(dtype).unsqueeze(-1)
        return cls(pool=pool, b=int(starts.numel()), t_new=t_new, bias=torch.cat([bias, bias]).unsqueeze(1),
                   mask=torch.cat([valid, valid]), has_prefix=(starts > 0).to(dtype).view(-1, 1, 1),
                   base=slots * pool.n_steps, step=torch.zeros((), dtype=torch.long, device=device),
                   row_start=starts.to(torch.long), row_new=new.to(torch.long),
                   row_streaming=streaming.to(torch.long), chunk=int(chunk))

    def step_io(self) -> "PrefixStepIO":
        """The prefix reads of the next Euler step (the step counter, on the device)."""
        return PrefixStepIO(self)


class PrefixStepIO:
    """One Euler step's reads of a :class:`PrefixPlan` (the interface of
    :class:`~cosyserve.models.flow_estimator.StreamStepIO`: the U-Net visits its sites in the same order
    every step). No host synchronisation: the step index is the plan's device counter."""

    def __init__(self, plan: PrefixPlan):
        self.plan = plan
        pool = plan.pool
        self._rows = plan.base + plan.step                                      # [B] (slot, step) rows
        ctx = pool.contexts.flatten(0, 1).index_select(0, self._rows)           # [B, 2, W]
        self._ctx = (ctx * plan.has_prefix).transpose(0, 1)                     # [2, B, W], 0 without prefix
        self._offset = 0
        self._site = 0

    def context(self, x: Tensor, kernel: int) -> Tensor:
        """``x [2B, Tn, C]`` (new frames) -> ``[2B, kernel - 1 + Tn, C]``: each row's prefix context
        before it (zeros for a row without prefix: the causal zero padding)."""
        c, ch = kernel - 1, x.size(-1)
        w = c * ch
        ctx = self._ctx[..., self._offset:self._offset + w].reshape(2 * self.plan.b, c, ch)
        self._offset += w
        return torch.cat([ctx.to(x.dtype), x], dim=1)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
        """The attention of this step's next site: ``q``, ``k``, ``v [2B, H, Tn, D]`` of the new frames,
        ``bias`` the plan's ``[2B, 1, Tn, S + Tn]`` -> ``[2B, H, Tn, D]`` over the rows' prefix keys then the
        new ones: the pool-reading kernel where it runs
        (:func:`~cosyserve.models.prefix_attention.prefix_attention`), else :meth:`keys_values` and SDPA."""
        p, pool = self.plan, self.plan.pool
        out = prefix_attention(q, k, v, pool.keys, pool.values, self._rows, self._site, p.row_start, p.row_new,
                               p.row_streaming, p.chunk)
        if out is not None:
            self._site += 1
            return out
        k, v = self.keys_values(k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    def keys_values(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``k, v [2B, H, Tn, D]`` of the new frames -> ``[2B, H, S + Tn, D]``: the rows' prefix keys/values
        of this step and site (``S`` = the pool's ``max_frames``, masked past each row's prefix), then the
        new ones."""
        p, pool = self.plan, self.plan.pool
        rows = self._rows * pool.n_sites + self._site
        self._site += 1
        out = []
        for store, new in ((pool.keys, k), (pool.values, v)):
            old = store.flatten(0, 2).index_select(0, rows)                     # [B, 2, H, S, D]
            old = old.transpose(0, 1).reshape(2 * p.b, *old.shape[2:])          # CFG rows first: [2B, H, S, D]
            out.append(torch.cat([old, new], dim=2))
        return out[0], out[1]

    def finish(self) -> None:
        """After the step: advance the plan's step counter (in place: a replayed step reads the next)."""
        self.plan.step.add_(1)
