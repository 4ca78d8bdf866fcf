"""Velocity estimator of the CosyVoice2 conditional flow matching: a causal 1-D U-Net.

Algorithm source: CosyVoice commit ace7c47, ``cosyvoice/flow/decoder.py``
(``CausalConditionalDecoder``, ``CausalResnetBlock1D``, ``CausalBlock1D``,
``CausalConv1d``) built from Matcha-TTS (commit dd9105b) components
``matcha/models/components/decoder.py`` (``SinusoidalPosEmb``, ``TimestepEmbedding``,
``ResnetBlock1D``, ``Downsample1D``, ``Upsample1D``) and ``transformer.py``
(``BasicTransformerBlock`` with diffusers' ``Attention``: q/k/v projections without bias,
output projection with bias, scale ``head_dim ** -0.5``, additive mask bias; and
``FeedForward`` with diffusers' ``GELU``: Linear ``proj`` then exact GELU, 4x width).
Independent plain-torch re-implementation (no diffusers/einops); attribute names follow
upstream only so that ``state_dict()`` keys equal ``decoder.estimator.*`` of ``flow.pt``.

Inputs are channel-first ``[B, C, T]`` at the mel frame rate (50 frames/s). Every
convolution either is causal or reads inputs that were multiplied by the (per-level)
padding mask first, LayerNorms are per position and attention masks padded keys, so a
right-padded batch gives, at each item's valid positions, the values of that item alone.

Attention masks (upstream ``add_optional_chunk_mask`` + ``mask_to_bias``): the key
padding mask of the level, AND, for items decoded in streaming mode, the chunk-causal
mask with chunks of ``static_chunk_size`` frames counted from frame 0 (the same chunk size
at every U-Net level, as upstream; ``num_decoding_left_chunks`` is ignored upstream and
here: all left chunks are visible). Disallowed positions get bias ``-1e10`` (float16:
its most negative finite value; upstream's product overflows to ``-inf`` there; both give
exactly zero weight).

Host synchronisation: none in :meth:`FlowEstimator.forward_planned`; padding masks are
built once per solve by :meth:`FlowEstimator.attention_plan`, the attention biases from them
in every forward (a few elementwise kernels; kept for the solve they would be the largest
tensors a CUDA-graph bucket holds between steps: ``[2B, 1, T, T]``). Static shapes per batch make the
planned forward suitable for CUDA-graph capture / ``torch.compile`` by the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from .config import EstimatorConfig
from .derived import DerivedWeights
from .flow_encoder import chunk_attention_mask, segment_index_on
from .fused import FusedOp, linear_gelu
from .transfer import to_device

_MASK_BIAS = -1.0e10  # upstream cosyvoice.utils.common.mask_to_bias


def sinusoidal_time_embedding(t: Tensor, dim: int, scale: float = 1000.0) -> Tensor:
    """Matcha ``SinusoidalPosEmb``: ``t [B]`` (flow time in [0, 1]) -> ``[B, dim]`` in ``t.dtype``.

    ``[sin(scale * t * w_k), cos(scale * t * w_k)]`` with ``w_k = exp(-k ln(10000) / (dim/2 - 1))``,
    frequencies in float32.
    """
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    angles = scale * t.unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat((angles.sin(), angles.cos()), dim=-1).to(t.dtype)


class TimestepEmbedding(nn.Module):
    """``linear_2(silu(linear_1(x)))``: ``[B, in_channels] -> [B, time_embed_dim]``."""

    def __init__(self, in_channels: int, time_embed_dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_embed_dim)
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


def causal_im2col(x: Tensor, kernel: int) -> Tensor:
    """``x [B, T, C]`` -> ``[B*T, kernel*C]`` whose row ``(b, t)`` is the frames
    ``x[b, t-kernel+1 .. t]`` (zeros before frame 0), oldest first: a causal convolution
    becomes one GEMM with :meth:`CausalConv1d.matrix`."""
    b, t, c = x.shape
    xp = F.pad(x, (0, 0, kernel - 1, 0))
    return xp.as_strided((b, t, kernel, c), ((t + kernel - 1) * c, c, c, 1)).reshape(b * t, kernel * c)


class CausalConv1d(nn.Conv1d):
    """Stride-1 convolution padded with ``kernel_size - 1`` zeros on the left only.

    :meth:`forward` takes upstream's channel-first ``[B, C, T]``; :meth:`forward_btc` the
    estimator's frame-major ``[B, T, C]`` (one GEMM over :func:`causal_im2col`)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__(in_channels, out_channels, kernel_size)
        self._derived = DerivedWeights()

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))

    def matrix(self) -> Tensor:
        """The weight as ``[C_out, kernel*C_in]`` in :func:`causal_im2col`'s column order."""
        w = self.weight
        return self._derived.get("matrix", (w,), lambda: w.detach().permute(0, 2, 1).reshape(w.shape[0], -1))

    def forward_btc(self, x: Tensor, io: "StreamStepIO | None" = None) -> Tensor:
        """``[B, T, C_in] -> [B, T, C_out]``; with ``io`` (a stream-cached step) the left context
        comes from the stream caches instead of zeros (:meth:`StreamStepIO.context`)."""
        if io is not None:
            k = self.kernel_size[0]
            return self.forward_btc(io.context(x, k))[:, k - 1:]
        b, t, _ = x.shape
        return F.linear(causal_im2col(x, self.kernel_size[0]), self.matrix(), self.bias).view(b, t, -1)

    def taps(self) -> Tensor:
        """The weight as ``[kernel*C_out, C_in]``: rows ``j*C_out .. (j+1)*C_out`` are tap ``j``
        (applied to frame ``t - (kernel-1) + j``), so ``linear(x, taps())`` gives every tap's
        contribution of every frame at once (see :func:`causal_taps_sum`)."""
        w = self.weight
        return self._derived.get("taps", (w,), lambda: w.detach().permute(2, 0, 1).reshape(-1, w.shape[1]))


def causal_taps_sum(taps: Tensor, bias: Tensor) -> Tensor:
    """A causal convolution from its per-tap products: ``taps [B, T, k*C]`` (``linear(x,
    CausalConv1d.taps())``), ``bias [C]`` -> ``[B, T, C]`` with frame ``t`` =
    ``bias + sum_j taps_j[t - (k-1) + j]`` (frames before 0 count as zero). Shifting the
    GEMM's output instead of its input replaces the im2col copy of the input (and its padding
    copy) by index arithmetic that a fused kernel does for free."""
    c = bias.shape[0]
    k = taps.shape[-1] // c
    t = taps.shape[1]
    padded = F.pad(taps, (0, 0, k - 1, 0))
    y = bias + padded[:, k - 1:, (k - 1) * c:]
    for j in range(k - 1):
        y = y + padded[:, j:j + t, j * c:(j + 1) * c]
    return y


def _add_layer_norm_eager(x: Tensor, y: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    s = x + y
    return s, F.layer_norm(s, (s.shape[-1],), weight, bias, eps)


def _conv_layer_norm_mish_eager(taps: Tensor, conv_bias: Tensor, weight: Tensor, bias: Tensor, eps: float,
                                add: Tensor | None) -> Tensor:
    y = causal_taps_sum(taps, conv_bias).float()  # the taps' sum in float32, rounded once
    y = F.mish(F.layer_norm(y, (y.shape[-1],), weight.float(), bias.float(), eps))
    return (y if add is None else y + add).to(taps.dtype)


def _conv_layer_norm_mish_norm_eager(taps: Tensor, conv_bias: Tensor, weight: Tensor, bias: Tensor, eps: float,
                                     add: Tensor | None, norm_weight: Tensor, norm_bias: Tensor,
                                     norm_eps: float) -> tuple[Tensor, Tensor]:
    out = _conv_layer_norm_mish_eager(taps, conv_bias, weight, bias, eps, add)
    return out, F.layer_norm(out, (out.shape[-1],), norm_weight, norm_bias, norm_eps)


#: ``(x + y, LayerNorm(x + y))`` over the last dim: a residual add and the next pre-norm, one
#: kernel on CUDA (:mod:`cosyserve.models.fused`)
add_layer_norm = FusedOp(_add_layer_norm_eager, "add_layer_norm")
#: a causal convolution's tap sum (:func:`causal_taps_sum`), LayerNorm, Mish and an optional
#: add (broadcast), one kernel on CUDA: :class:`CausalBlock` after its GEMM
conv_layer_norm_mish = FusedOp(_conv_layer_norm_mish_eager, "conv_layer_norm_mish")
#: the same and the next pre-norm's LayerNorm of its (rounded) result: ``(out, LayerNorm(out))``
conv_layer_norm_mish_norm = FusedOp(_conv_layer_norm_mish_norm_eager, "conv_layer_norm_mish_norm")


class CausalBlock(nn.Module):
    """``mish(LayerNorm_channels(causal_conv3(x)))`` on ``[B, T, C_in] -> [B, T, C_out]``.

    Parameters live at ``block.0`` (conv) and ``block.2`` (LayerNorm, eps 1e-5) as upstream's
    ``Sequential(conv, transpose, LayerNorm, transpose, Mish)``. Upstream also multiplies the
    input and the output by the padding mask; neither changes a valid frame (the conv is
    causal and the batch right-padded, LayerNorm and Mish are per frame), so the mask is
    applied only where it matters (see :class:`FlowEstimator`).
    """

    def __init__(self, dim: int, dim_out: int):
        super().__init__()
        self.block = nn.Sequential(CausalConv1d(dim, dim_out, 3), nn.Identity(), nn.LayerNorm(dim_out), nn.Identity())

    def forward(self, x: Tensor, add: Tensor | None = None, io: "StreamStepIO | None" = None) -> Tensor:
        """``mish(LayerNorm(conv(x))) (+ add)``; ``add`` broadcasts to ``[B, T, C_out]``.

        The convolution is one GEMM of ``x`` with every tap (:meth:`CausalConv1d.taps`); the
        shifted sum of the taps, LayerNorm, Mish and the add are one fused kernel on CUDA
        (:data:`conv_layer_norm_mish`, computed in float32 and rounded once). With ``io`` (a
        stream-cached step) the conv's left context comes from the stream caches."""
        conv, ln = self.block[0], self.block[2]
        if io is not None:
            x, add, cut = _with_context(io, x, add, conv.kernel_size[0])
            return self.forward(x, add)[:, cut:]
        return conv_layer_norm_mish(F.linear(x, conv.taps()), conv.bias, ln.weight, ln.bias, ln.eps, add)

    def forward_normed(self, x: Tensor, add: Tensor | None, norm: nn.LayerNorm,
                       io: "StreamStepIO | None" = None) -> tuple[Tensor, Tensor]:
        """``(forward(x, add), norm(forward(x, add)))``, the LayerNorm in the same fused kernel
        (:data:`conv_layer_norm_mish_norm`): the pre-norm of the transformer block that follows."""
        conv, ln = self.block[0], self.block[2]
        if io is not None:
            x, add, cut = _with_context(io, x, add, conv.kernel_size[0])
            out, normed = self.forward_normed(x, add, norm)
            return out[:, cut:], normed[:, cut:]
        return conv_layer_norm_mish_norm(F.linear(x, conv.taps()), conv.bias, ln.weight, ln.bias, ln.eps, add,
                                         norm.weight, norm.bias, norm.eps)


def _with_context(io: "StreamStepIO", x: Tensor, add: Tensor | None, kernel: int):
    """``x`` with its cached left context prepended (``kernel - 1`` frames), ``add`` padded to
    match when it is per frame, and the number of leading output frames to drop."""
    cut = kernel - 1
    # a per-frame add (the residual, [2B, T, C]) gets zeros for the context frames; a broadcast one
    # ([1 or 2B, 1, C]) is left as it is unless T == 1, where padding it is harmless too: the
    # context frames' outputs are dropped and every other frame keeps its add
    per_frame = add is not None and add.dim() == 3 and add.size(1) == x.size(1)
    x = io.context(x, kernel)
    if per_frame:
        add = F.pad(add, (0, 0, cut, 0))
    return x, add, cut


class CausalResnetBlock(nn.Module):
    """``block2(block1(x) + mlp(t_emb)) + res_conv(x)`` on ``[B, T, C_in] -> [B, T, C_out]``.

    ``mlp`` (Mish, Linear) is evaluated for all ResNet blocks at once by
    :meth:`FlowEstimator.time_terms`; ``forward`` takes its result ``t_term [B or 1, C_out]``.
    """

    def __init__(self, dim: int, dim_out: int, time_emb_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = CausalBlock(dim, dim_out)
        self.block2 = CausalBlock(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: Tensor, t_term: Tensor) -> Tensor:
        return self.forward_normed(x, t_term, None)[0]

    def forward_normed(self, x: Tensor, t_term: Tensor, norm: nn.LayerNorm | None,
                       io: "StreamStepIO | None" = None) -> tuple[Tensor, Tensor | None]:
        """``(forward(x, t_term), norm(...) or None)``: with ``norm`` (the next transformer block's
        pre-norm) the LayerNorm is computed by ``block2``'s fused kernel; ``io``: a stream-cached
        step (both causal convolutions read their left context from the stream caches)."""
        w = self.res_conv.weight
        res = F.linear(x, w.view(w.shape[0], w.shape[1]), self.res_conv.bias)
        h = self.block1(x, t_term.unsqueeze(1), io=io)
        if norm is None:
            return self.block2(h, res, io=io), None
        return self.block2.forward_normed(h, res, norm, io=io)


class Downsample(nn.Module):
    """Matcha ``Downsample1D``: conv kernel 3, stride 2, padding 1 (``T -> ceil(T/2)``);
    ``[B, T, C]`` in and out (not causal: the caller masks padded frames first)."""

    def __init__(self, dim: int):
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, 3, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class Upsample(nn.Module):
    """Matcha ``Upsample1D`` (transposed conv kernel 4, stride 2, padding 1: ``T -> 2T``);
    ``[B, T, C]`` in and out (not causal: the caller masks padded frames first)."""

    def __init__(self, dim: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(dim, dim, 4, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class SelfAttention(nn.Module):
    """diffusers ``Attention`` (self-attention only) on ``[B, T, dim]`` with an additive bias;
    q/k/v run as one GEMM over their concatenated weights."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
        self._derived = DerivedWeights()

    def qkv_weight(self) -> Tensor:
        """``[3 * inner, dim]``: ``to_q``, ``to_k``, ``to_v`` weights stacked."""
        ws = (self.to_q.weight, self.to_k.weight, self.to_v.weight)
        return self._derived.get("qkv", ws, lambda: torch.cat([w.detach() for w in ws]))

    def forward(self, x: Tensor, bias: Tensor, io: "StreamStepIO | None" = None) -> Tensor:
        """``x [B, T, dim]``, ``bias [B, 1, T, T]`` (0 or -1e10) -> ``[B, T, dim]``. With ``io``
        (a stream-cached or prefixed step) the keys/values are the cached ones followed by these
        (:meth:`StreamStepIO.attention`) and ``bias`` is ``[B, 1, T, S + T]``."""
        b, t, _ = x.shape
        q, k, v = F.linear(x, self.qkv_weight()).view(b, t, 3, self.heads, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        # q/k/v are strided views of the one GEMM's output; the fused attention kernels read them
        # in place and return [B, H, T, D] laid out as [B, T, H, D], so the reshape below is a view
        if io is not None:  # StreamStepIO or flow_prefix.PrefixStepIO
            out = io.attention(q.transpose(1, 2), k, v, bias)
        else:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=bias)
        return self.to_out[0](out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class GeluProjection(nn.Module):
    """diffusers ``GELU``: ``gelu(proj(x))`` (exact erf GELU; in half precision on CUDA the
    GEMM's tanh-approximated GELU epilogue, :func:`~cosyserve.models.fused.linear_gelu`)."""

    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, x: Tensor) -> Tensor:
        return linear_gelu(x, self.proj.weight, self.proj.bias)


class FeedForward(nn.Module):
    """``net.2(net.0(x))`` with ``net.0`` = :class:`GeluProjection` to ``4 * dim``."""

    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        self.net = nn.ModuleList([GeluProjection(dim, dim * mult), nn.Identity(), nn.Linear(dim * mult, dim)])

    def forward(self, x: Tensor) -> Tensor:
        return self.net[2](self.net[0](x))


class TransformerBlock(nn.Module):
    """Matcha ``BasicTransformerBlock`` as configured by CosyVoice2 (self-attention + FFN, pre-norm)."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = SelfAttention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        """``x + attn1(norm1(x))``, then ``+ ff(norm3(.))``: ``[B, T, dim]``, ``bias [B, 1, T, T]``."""
        return self.forward_fused(x, self.norm1(x), bias, None)[0]

    def forward_fused(self, x: Tensor, x_norm1: Tensor, bias: Tensor, next_norm: nn.LayerNorm | None,
                      io: "StreamStepIO | None" = None):
        """:meth:`forward` given ``x_norm1 = norm1(x)``, with each residual add fused into the
        LayerNorm that follows it (:func:`add_layer_norm`): returns ``(out, next_norm(out))``,
        or ``(out, None)`` without ``next_norm``. ``io``: a stream-cached step (cached keys/values)."""
        n3 = self.norm3
        x, h = add_layer_norm(x, self.attn1(x_norm1, bias, io), n3.weight, n3.bias, n3.eps)
        f = self.ff(h)
        if next_norm is None:
            return x + f, None
        return add_layer_norm(x, f, next_norm.weight, next_norm.bias, next_norm.eps)


@dataclass
class AttentionPlan:
    """Per-U-Net-level masks of a solve, computed once and reused by every Euler step.

    ``masks[d]``: ``[B, T_d, 1]`` padding mask (model dtype, 1 valid / 0 padded) at level
    ``d`` (``T_0 = T``, ``T_{d+1} = ceil(T_d / 2)``); ``streaming``: ``[B]`` bool, rows with
    chunk-causal attention (chunks of ``chunk`` frames).
    """

    masks: list[Tensor]
    streaming: Tensor
    chunk: int

    def biases(self) -> list[Tensor]:
        """Per level the additive attention bias ``[B, 1, T_d, T_d]`` (model dtype, 0 allowed,
        -1e10 masked: padded keys and, for streaming rows, keys in later chunks). No host
        synchronisation."""
        out = []
        for m in self.masks:
            # upstream's -1e10 overflows float16 (to -inf there); the most negative finite value
            # gives the same exactly-zero attention weight
            masked_value = max(_MASK_BIAS, torch.finfo(m.dtype).min)
            allowed = chunk_attention_mask(m[..., 0].bool(), self.streaming, self.chunk)
            out.append(torch.zeros(allowed.shape, dtype=m.dtype, device=m.device)
                       .masked_fill_(~allowed, masked_value).unsqueeze(1))
        return out


@dataclass
class EstimatorStreamCache:
    """One stream's exactly reusable estimator work (issue 17): for the first :attr:`frames`
    mel frames (a whole number of static chunks, prompt included, counted from frame 0) the
    state of every Euler step, for both CFG rows, as later streaming calls need it.

    In streaming mode (chunk-causal attention over ``static_chunk_size`` frames, causal
    convolutions, one U-Net level) a frame in a complete static chunk reads only frames of
    complete chunks, and its inputs (noise indexed by frame, ``mu`` of complete encoder chunks,
    ``cond``, ``spks``, ``t``) do not change when tokens are appended; so its keys/values and
    activations at every step are those of any later streaming call of the same stream.

    Attributes (model dtype, model device; all Euler steps in one tensor, so that a solve loads and
    stores a stream's cache with one copy per kind):
        frames: cached frames ``s`` (a multiple of the chunk size; 0 = empty).
        n_steps: Euler steps the cache was built with.
        keys, values: ``[n_steps, n_sites, 2, heads, s, head_dim]``: at every step, every transformer
            block's (U-Net order) attention keys/values of frames ``[0, s)``; row 0 conditional, row 1
            unconditional (CFG). None while empty.
        contexts: ``[n_steps, 2, W]``: at every step, every causal convolution's (U-Net order) input at
            frames ``[s - kernel + 1, s)``, each flattened ``(kernel - 1) * C_in`` and concatenated
            (``W`` = their sum). None while empty.

    Owned by one stream (the engine's :class:`~cosyserve.engine.request.SegmentState` through
    :class:`~cosyserve.models.flow.FlowStreamCache`); never shared, freed by :meth:`clear`.
    """

    frames: int = 0
    n_steps: int = 0
    keys: Tensor | None = None
    values: Tensor | None = None
    contexts: Tensor | None = None

    def clear(self) -> None:
        """Drop every tensor (``frames`` = 0)."""
        self.frames, self.n_steps = 0, 0
        self.keys = self.values = self.contexts = None

    def nbytes(self) -> int:
        """Bytes held by the cached tensors."""
        ts = [t for t in (self.keys, self.values, self.contexts) if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)


class StreamCachePlan:
    """Masks and cache traffic of one stream-cached solve (used in place of an
    :class:`AttentionPlan`; :meth:`FlowEstimator.forward_btc` dispatches on the type).

    The batch holds, per item ``b``, only the frames ``[starts[b], starts[b] + new[b])`` (right-
    padded to ``Tn``); frames before ``starts[b]`` come from ``caches[b]`` (keys/values padded to
    ``S = max(starts)`` and masked past ``starts[b]``; causal convolutions' left context).
    ``commit[b]``: frames of the item's cache after the last step (``> starts[b]`` appends the
    keys/values and contexts of ``[starts[b], commit[b])``, else the cache is left as it is).
    The attention bias ``[2B, 1, Tn, S + Tn]`` is built once: key ``j`` of the cache part is
    allowed iff ``j < starts[b]``; key ``j`` of the new part iff ``j < new[b]`` and, for a
    streaming item, frame ``starts[b] + j`` lies before the end of the query's static chunk.
    Steps must be run in order (:meth:`step_io` / :meth:`StreamStepIO.finish`). Cache traffic with a
    few operations per step whatever the batch: each step's padded buffer ``[n_sites, 2, B, H, S + Tn,
    D]`` is filled with one ``cat`` of the cached items' keys/values of that step and one indexed copy
    per kind, and each step's keys/values of the growing items' new cache frames (cached, then new) are
    gathered into one tensor for all steps (one indexed copy per kind), split into the items' own new
    caches after the last step (one copy per kind and item; each replaces the item's old cache at once,
    so the peak memory is that of the old caches plus the new ones, as before). The caches are written
    after the last step only, so a failed solve leaves them as they were.
    """

    def __init__(self, caches: list, starts: list[int], new: list[int], commit: list[int],
                 streaming: list[bool], chunk: int, n_steps: int, n_sites: int, heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype):
        self.caches, self.starts, self.new, self.commit = caches, starts, new, commit
        self.b = len(starts)
        self.s_max, self.t_new = max(starts), max(new)
        self.n_steps, self.n_sites, self.heads, self.head_dim = n_steps, n_sites, heads, head_dim
        self.k = 0
        self._grown_kv: tuple | None = None  # growing items' new (keys, values) [n_steps, n_sites, 2, H, sum c, D]
        self.ctx: Tensor | None = None    # [n_steps, 2, B, W] the cached convolution contexts
        self._new_ctx: list[Tensor] = []  # per step [2, B, W]
        self.cached = [b for b, c in enumerate(caches) if c is not None and starts[b] > 0]
        self.grown = [b for b, c in enumerate(caches) if c is not None and commit[b] > starts[b]]
        start = to_device(torch.tensor(starts), device).view(-1, 1)
        n_new = to_device(torch.tensor(new), device).view(-1, 1)
        stream = to_device(torch.tensor(streaming, dtype=torch.bool), device).view(-1, 1, 1)
        i = torch.arange(self.t_new, device=device).view(1, -1)
        q_abs = start + i                                                   # [B, Tn]
        cache_ok = torch.arange(self.s_max, device=device).view(1, -1) < start  # [B, S]
        k_abs = start + i                                                   # [B, Tn] key frames
        k_ok = i < n_new                                                    # [B, Tn]
        if chunk > 0:
            chunk_end = (torch.div(q_abs, chunk, rounding_mode="floor") + 1) * chunk
            causal = k_abs.unsqueeze(1) < chunk_end.unsqueeze(2)            # [B, Tn(q), Tn(k)]
            new_ok = k_ok.unsqueeze(1) & (causal | ~stream)
        else:
            new_ok = k_ok.unsqueeze(1).expand(-1, self.t_new, -1)
        allowed = torch.cat([cache_ok.unsqueeze(1).expand(-1, self.t_new, -1), new_ok], dim=2)
        masked_value = max(_MASK_BIAS, torch.finfo(dtype).min)
        bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, masked_value)
        self.bias = torch.cat([bias, bias]).unsqueeze(1)                    # [2B, 1, Tn, S + Tn]
        valid = (i < n_new).to(dtype).unsqueeze(-1)                         # [B, Tn, 1]
        self.mask = torch.cat([valid, valid])                               # [2B, Tn, 1]

    def step_io(self) -> "StreamStepIO":
        """The cache access of the next Euler step."""
        if self.k >= self.n_steps:
            raise RuntimeError("stream-cached solve: all steps were already run")
        return StreamStepIO(self, self.k)

    def _load(self, like: Tensor) -> None:
        """At the first step (``like``: a tensor of the model dtype/device): index tensors, the cached
        contexts of all steps ``[n_steps, 2, B, W]``, the growing items' new keys/values buffers."""
        device = like.device
        if self.cached:
            self._load_at = segment_index_on(device, self.cached, [self.starts[b] for b in self.cached],
                                             [0] * len(self.cached))
        width = max((self.caches[b].contexts.size(-1) for b in self.cached), default=0)
        self.ctx = like.new_zeros(self.n_steps, 2, self.b, width)
        if self.cached:
            rows = to_device(torch.tensor(self.cached), device)
            self.ctx.index_copy_(2, rows, torch.stack([self.caches[b].contexts for b in self.cached], dim=2))
        if self.grown:
            rows, lens, offs = [], [], []
            for b in self.grown:  # each growing item's cached frames, then its new ones after the padding
                rows += [b, b]
                lens += [self.starts[b], self.commit[b] - self.starts[b]]
                offs += [0, self.s_max]
            self._grow_at = segment_index_on(device, rows, lens, offs)
            shape = (self.n_steps, self.n_sites, 2, self.heads, sum(lens), self.head_dim)
            self._grown_kv = (like.new_empty(shape), like.new_empty(shape))

    def step_buffers(self, step: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """Step ``step``'s keys/values buffers ``[n_sites, 2, B, H, S + Tn, D]``: zeros, each cached item's
        keys/values in its first ``starts[b]`` frames (one indexed copy per kind)."""
        if self.ctx is None:
            self._load(like)
        shape = (self.n_sites, 2, self.b, self.heads, self.s_max + self.t_new, self.head_dim)
        bufs = like.new_zeros(shape), like.new_zeros(shape)
        if self.cached:
            row, at = self._load_at
            for buf, kind in zip(bufs, ("keys", "values")):
                old = torch.cat([getattr(self.caches[b], kind)[step] for b in self.cached], dim=3)
                buf[:, :, row, :, at] = old.permute(3, 0, 1, 2, 4)  # [sum s, n_sites, 2, H, D]
        return bufs

    def _finish_step(self, io: "StreamStepIO") -> None:
        if self.grown:
            self._new_ctx.append(io.new_contexts())
            row, at = self._grow_at
            for out, buf in zip(self._grown_kv, (io.kbuf, io.vbuf)):
                out[self.k].copy_(buf[:, :, row, :, at].permute(1, 2, 3, 0, 4))
        self.k += 1
        if self.k == self.n_steps and self.grown:
            rows = to_device(torch.tensor(self.grown), self.ctx.device)
            ctx = torch.stack(self._new_ctx).index_select(2, rows).unbind(2)  # per item [n_steps, 2, W]
            sizes = [self.commit[b] for b in self.grown]
            keys, values = (t.split(sizes, dim=4) for t in self._grown_kv)
            for g, b in enumerate(self.grown):  # own copies: no stream keeps the batch's tensor alive
                # (each replaces the stream's old cache at once: old + new caches at most, as before)
                cache = self.caches[b]
                cache.keys = keys[g].clone(memory_format=torch.contiguous_format)
                cache.values = values[g].clone(memory_format=torch.contiguous_format)
                cache.contexts = ctx[g].clone()
                cache.frames, cache.n_steps = self.commit[b], self.n_steps
            self._grown_kv, self._new_ctx = None, []


class StreamStepIO:
    """One Euler step's access to the stream caches of a :class:`StreamCachePlan` (the U-Net's
    sites are visited in the same order every step: causal convolutions and attention blocks are
    numbered by their order of use)."""

    def __init__(self, plan: StreamCachePlan, step: int):
        self.plan, self.step = plan, step
        self._offset = 0
        self._attn = 0
        self.kbuf: Tensor | None = None
        self.vbuf: Tensor | None = None
        self.inputs: list[Tensor] = []
        self._new_ctx: Tensor | None = None

    def context(self, x: Tensor, kernel: int) -> Tensor:
        """``x [2B, Tn, C]`` (new frames) -> ``[2B, kernel - 1 + Tn, C]`` with each item's cached
        left context (zeros for an item without cache: the causal zero padding)."""
        p, c, ch = self.plan, kernel - 1, x.size(-1)
        if p.ctx is None:
            p._load(x)
        step_ctx = p.ctx[self.step]  # [2, B, W]: all sites' contexts of this step
        w = c * ch
        if step_ctx.size(-1) >= self._offset + w:
            ctx = step_ctx[..., self._offset:self._offset + w].reshape(2 * p.b, c, ch)
        else:  # no stream of the batch has a cache
            ctx = x.new_zeros(2 * p.b, c, ch)
        self._offset += w
        ext = torch.cat([ctx, x], dim=1)
        self.inputs.append(ext)
        return ext

    def new_contexts(self) -> Tensor:
        """``[2, B, W]``: every site's input at the ``kernel - 1`` frames before each item's
        ``commit`` frame (gathered once per step; rows of items that do not grow are unused)."""
        if self._new_ctx is None:
            p = self.plan
            m = to_device(torch.tensor([max(0, c - s) for c, s in zip(p.commit, p.starts)]), self.inputs[0].device)
            rows = torch.arange(p.b, device=m.device).view(-1, 1)
            parts = []
            for ext in self.inputs:
                k1 = ext.size(1) - p.t_new
                idx = m.view(-1, 1) + torch.arange(k1, device=m.device).view(1, -1)  # [B, k - 1]
                parts.append(ext.view(2, p.b, ext.size(1), ext.size(2))[:, rows, idx].reshape(2, p.b, -1))
            self._new_ctx = torch.cat(parts, dim=-1)
        return self._new_ctx

    def attention(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
        """The attention of this step's next site: ``q``, ``k``, ``v [2B, H, Tn, D]`` of the new frames,
        ``bias [2B, 1, Tn, S + Tn]`` -> ``[2B, H, Tn, D]`` over the cached keys then the new ones
        (:meth:`keys_values`, SDPA)."""
        k, v = self.keys_values(k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    def keys_values(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``k, v [2B, H, Tn, D]`` of the new frames -> ``[2B, H, S + Tn, D]``: each item's cached
        keys/values (padded to ``S``), then the new ones."""
        p = self.plan
        if self.kbuf is None:
            self.kbuf, self.vbuf = p.step_buffers(self.step, k)
        site = self._attn
        self._attn += 1
        shape = (2, p.b, p.heads, p.t_new, p.head_dim)
        kb, vb = self.kbuf[site], self.vbuf[site]
        kb[:, :, :, p.s_max:] = k.reshape(shape)
        vb[:, :, :, p.s_max:] = v.reshape(shape)
        full = (2 * p.b, p.heads, p.s_max + p.t_new, p.head_dim)
        return kb.view(full), vb.view(full)

    def finish(self) -> None:
        """After the step: stage the new cache parts (written to the caches after the last step)."""
        self.plan._finish_step(self)


class FlowEstimator(nn.Module):
    """Causal 1-D U-Net predicting the flow-matching velocity.

    Layout (``channels = (c_0, ..., c_{n-1})``): per level a causal ResNet block,
    ``n_blocks`` transformer blocks and a stride-2 downsample (a causal kernel-3 conv on
    the last level); ``num_mid_blocks`` ResNet+transformer stages; mirrored up path with
    skip concatenation and transposed-conv upsampling (causal conv on the last level);
    final causal block and 1x1 projection to ``out_channels`` mel bins.

    Raises :class:`~cosyserve.errors.ConfigError` for an ``act_fn`` other than ``'gelu'``.
    """

    def __init__(self, cfg: EstimatorConfig):
        super().__init__()
        if cfg.act_fn != "gelu":
            raise ConfigError(f"flow estimator: act_fn {cfg.act_fn!r} unsupported (CosyVoice2 uses 'gelu')")
        if not cfg.channels:
            raise ConfigError("flow estimator: channels must not be empty")
        self.cfg = cfg
        channels = tuple(cfg.channels)
        t_dim = channels[0] * 4
        self.time_mlp = TimestepEmbedding(cfg.in_channels, t_dim)

        def transformers(dim: int) -> nn.ModuleList:
            return nn.ModuleList(
                TransformerBlock(dim, cfg.num_heads, cfg.attention_head_dim) for _ in range(cfg.n_blocks)
            )

        self.down_blocks = nn.ModuleList()
        c_in = cfg.in_channels
        for i, c in enumerate(channels):
            last = i == len(channels) - 1
            down = CausalConv1d(c, c, 3) if last else Downsample(c)
            self.down_blocks.append(nn.ModuleList([CausalResnetBlock(c_in, c, t_dim), transformers(c), down]))
            c_in = c
        self.mid_blocks = nn.ModuleList(
            nn.ModuleList([CausalResnetBlock(channels[-1], channels[-1], t_dim), transformers(channels[-1])])
            for _ in range(cfg.num_mid_blocks)
        )
        up_channels = channels[::-1] + (channels[0],)
        self.up_blocks = nn.ModuleList()
        for i in range(len(up_channels) - 1):
            c = up_channels[i + 1]
            last = i == len(up_channels) - 2
            up = CausalConv1d(c, c, 3) if last else Upsample(c)
            self.up_blocks.append(
                nn.ModuleList([CausalResnetBlock(2 * up_channels[i], c, t_dim), transformers(c), up])
            )
        self.final_block = CausalBlock(up_channels[-1], up_channels[-1])
        self.final_proj = nn.Conv1d(up_channels[-1], cfg.out_channels, 1)
        self._derived = DerivedWeights()

    @property
    def depth(self) -> int:
        return len(self.cfg.channels)

    def attention_plan(self, mask: Tensor, streaming: Tensor | bool) -> AttentionPlan:
        """Masks for all levels from ``mask [B, 1, T]`` (1 valid / 0 padded, model dtype) and
        ``streaming`` (bool for the whole batch, or ``[B]`` bool per row)."""
        b = mask.size(0)
        if not isinstance(streaming, Tensor):
            streaming = torch.full((b,), bool(streaming), device=mask.device)
        streaming = streaming.to(device=mask.device, dtype=torch.bool)
        masks = []
        m = mask
        for _ in range(self.depth):
            masks.append(m.transpose(1, 2).contiguous())
            m = m[:, :, ::2]
        return AttentionPlan(masks, streaming, self.cfg.static_chunk_size)

    @property
    def supports_stream_cache(self) -> bool:
        """Stream caching (:class:`EstimatorStreamCache`) is exact only for a one-level U-Net
        (CosyVoice2: ``channels: [256]``): the resampling convolutions of deeper U-Nets read the
        next frame, so a frame's value would depend on a later chunk."""
        return self.depth == 1

    def attention_sites(self) -> int:
        """Transformer blocks (each one attention) in the U-Net."""
        return sum(len(blk[1]) for blk in list(self.down_blocks) + list(self.mid_blocks) + list(self.up_blocks))

    def stream_cache_values_per_frame(self) -> int:
        """Cached values per mel frame of an :class:`EstimatorStreamCache` (all steps, both CFG
        rows, keys and values; the convolution contexts are a constant ``kernel - 1`` frames):
        ``n_timesteps * 2 * 2 * attention_sites * heads * head_dim`` with ``n_timesteps`` given
        by the caller (:class:`~cosyserve.models.config.CFMConfig`)."""
        return 2 * 2 * self.attention_sites() * self.cfg.num_heads * self.cfg.attention_head_dim

    def stream_plan(self, caches: list, starts: list[int], new: list[int], commit: list[int],
                    streaming: list[bool], n_steps: int, device: torch.device,
                    dtype: torch.dtype) -> StreamCachePlan:
        """A :class:`StreamCachePlan` for this U-Net (see there for the arguments)."""
        if not self.supports_stream_cache:
            raise ValueError(f"flow estimator: stream caching needs a one-level U-Net, this one has {self.depth}")
        return StreamCachePlan(caches, starts, new, commit, streaming, self.cfg.static_chunk_size, n_steps,
                               self.attention_sites(), self.cfg.num_heads, self.cfg.attention_head_dim,
                               device, dtype)

    def _forward_stream_cached(self, h: Tensor, plan, t: Tensor) -> Tensor:
        """:meth:`forward_btc` of the new frames of a stream-cached batch (one-level U-Net; ``plan`` a
        :class:`StreamCachePlan` or a :class:`~cosyserve.models.flow_prefix.PrefixPlan`: ``bias``, ``mask``,
        ``step_io()``): ``h [2B, Tn, in_channels]`` -> ``[2B, Tn, out_channels]``, zero at padded frames."""
        io = plan.step_io()
        terms = iter(self.time_terms(t))
        bias = plan.bias
        resnet, blocks, down = self.down_blocks[0]
        h = self._resnet_transformers(resnet, blocks, h, next(terms), bias, io)
        skip = h
        h = down.forward_btc(h, io)
        for resnet, blocks in self.mid_blocks:
            h = self._resnet_transformers(resnet, blocks, h, next(terms), bias, io)
        resnet, blocks, up = self.up_blocks[0]
        h = self._resnet_transformers(resnet, blocks, torch.cat([h, skip], dim=-1), next(terms), bias, io)
        h = up.forward_btc(h, io)
        h = self.final_block(h, io=io)
        w = self.final_proj.weight
        out = F.linear(h, w.view(w.shape[0], w.shape[1]), self.final_proj.bias) * plan.mask
        io.finish()
        return out

    def _resnets(self) -> list[CausalResnetBlock]:
        """Every ResNet block in forward order (down, mid, up)."""
        return [blk[0] for blk in self.down_blocks] + [blk[0] for blk in self.mid_blocks] + \
            [blk[0] for blk in self.up_blocks]

    def time_terms(self, t: Tensor) -> list[Tensor]:
        """Each ResNet block's ``mlp(time_mlp(sinusoidal(t)))`` ``[B, C_out]`` for flow time
        ``t [B]`` (or ``[1]``, broadcast over the batch), as one GEMM over the blocks' stacked
        ``mlp`` weights (their Mish input is the same)."""
        resnets = self._resnets()
        lins = [r.mlp[1] for r in resnets]
        srcs = tuple(p for lin in lins for p in (lin.weight, lin.bias))
        w, bias = self._derived.get("time_terms", srcs, lambda: (torch.cat([lin.weight.detach() for lin in lins]),
                                                                  torch.cat([lin.bias.detach() for lin in lins])))
        t_emb = self.time_mlp(sinusoidal_time_embedding(t, self.cfg.in_channels))
        return list(F.linear(F.mish(t_emb), w, bias).split([lin.out_features for lin in lins], dim=-1))

    def _resnet_transformers(self, resnet: CausalResnetBlock, blocks: nn.ModuleList, h: Tensor, t_term: Tensor,
                             bias: Tensor, io: "StreamStepIO | None" = None) -> Tensor:
        """One U-Net stage's ResNet block and transformer blocks; the first block's pre-norm is
        fused into the ResNet block's last kernel."""
        h, h_norm = resnet.forward_normed(h, t_term, blocks[0].norm1 if len(blocks) else None, io)
        return self._transformers(blocks, h, bias, h_norm, io)

    def _transformers(self, blocks: nn.ModuleList, h: Tensor, bias: Tensor, h_norm: Tensor | None,
                      io: "StreamStepIO | None" = None) -> Tensor:
        """The transformer blocks of one U-Net stage (:meth:`TransformerBlock.forward_fused`:
        each residual add fused with the next block's pre-norm); ``h_norm``: the first block's
        ``norm1(h)`` (None only without blocks)."""
        if len(blocks) == 0:
            return h
        for i, block in enumerate(blocks):
            nxt = blocks[i + 1].norm1 if i + 1 < len(blocks) else None
            h, h_norm = block.forward_fused(h, h_norm, bias, nxt, io)
        return h

    def forward_btc(self, h: Tensor, plan: AttentionPlan, t: Tensor) -> Tensor:
        """Velocity ``[B, T, out_channels]`` (zero at padded frames) from the packed input
        ``h [B, T, in_channels]`` = ``cat(x, mu, spks broadcast over T, cond)`` along channels,
        frame-major, a precomputed :class:`AttentionPlan`, and flow time ``t [B]`` or ``[1]``.
        All in the model dtype; no host synchronisation.

        Padded frames are masked only before the non-causal resampling convolutions and at
        the output: everywhere else a valid frame never reads a padded one (causal convs,
        masked attention keys, per-frame norms), which is what upstream's extra masking
        guarantees too.
        """
        if not isinstance(plan, AttentionPlan):  # a StreamCachePlan or a flow_prefix.PrefixPlan: new frames only
            return self._forward_stream_cached(h, plan, t)
        terms = iter(self.time_terms(t))
        biases = plan.biases()
        skips = []
        for level, (resnet, blocks, down) in enumerate(self.down_blocks):
            h = self._resnet_transformers(resnet, blocks, h, next(terms), biases[level])
            skips.append(h)
            h = down.forward_btc(h) if isinstance(down, CausalConv1d) else down(h * plan.masks[level])
        bottom = self.depth - 1
        for resnet, blocks in self.mid_blocks:
            h = self._resnet_transformers(resnet, blocks, h, next(terms), biases[bottom])
        for k, (resnet, blocks, up) in enumerate(self.up_blocks):
            level = bottom - k
            skip = skips.pop()
            h = torch.cat([h[:, : skip.size(1)], skip], dim=-1)
            h = self._resnet_transformers(resnet, blocks, h, next(terms), biases[level])
            h = up.forward_btc(h) if isinstance(up, CausalConv1d) else up(h * plan.masks[level])
        h = self.final_block(h)
        w = self.final_proj.weight
        return F.linear(h, w.view(w.shape[0], w.shape[1]), self.final_proj.bias) * plan.masks[0]

    def forward_planned(self, x: Tensor, plan: AttentionPlan, mu: Tensor, t: Tensor, spks: Tensor,
                        cond: Tensor) -> Tensor:
        """Velocity ``[B, out_channels, T]`` (zero at padded frames; a transposed view of
        frame-major memory) from a precomputed :class:`AttentionPlan`.

        ``x``, ``mu``, ``cond``: ``[B, n_mels, T]``; ``spks``: ``[B, n_mels]``; ``t``: ``[B]``
        flow time in [0, 1]; all in the model dtype. No host synchronisation.
        """
        frames = x.size(-1)
        h = torch.cat([x.transpose(1, 2), mu.transpose(1, 2), spks.unsqueeze(1).expand(-1, frames, -1),
                       cond.transpose(1, 2)], dim=-1)
        return self.forward_btc(h, plan, t).transpose(1, 2)

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                streaming: Tensor | bool = False) -> Tensor:
        """Upstream-compatible call: ``x, mu, cond [B, n_mels, T]``, ``mask [B, 1, T]``
        (1 valid / 0 padded), ``t [B]``, ``spks [B, n_mels]``, ``streaming`` bool or ``[B]``
        bool. Returns the velocity ``[B, out_channels, T]``, zero at padded frames."""
        return self.forward_planned(x, self.attention_plan(mask, streaming), mu, t, spks, cond)
