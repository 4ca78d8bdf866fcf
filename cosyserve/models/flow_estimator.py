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

Host synchronisation: none in :meth:`FlowEstimator.forward_planned`; masks are built once
per solve by :meth:`FlowEstimator.attention_plan`. Static shapes per batch make the
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
from .flow_encoder import chunk_attention_mask

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


class CausalConv1d(nn.Conv1d):
    """Stride-1 convolution padded with ``kernel_size - 1`` zeros on the left only."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__(in_channels, out_channels, kernel_size)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class CausalBlock(nn.Module):
    """``mish(LayerNorm_channels(causal_conv3(x * mask))) * mask``; ``[B, Cin, T] -> [B, Cout, T]``.

    Parameters live at ``block.0`` (conv) and ``block.2`` (LayerNorm, eps 1e-5) as upstream's
    ``Sequential(conv, transpose, LayerNorm, transpose, Mish)``.
    """

    def __init__(self, dim: int, dim_out: int):
        super().__init__()
        self.block = nn.Sequential(CausalConv1d(dim, dim_out, 3), nn.Identity(), nn.LayerNorm(dim_out), nn.Identity())

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.block[0](x * mask)
        h = self.block[2](h.transpose(1, 2)).transpose(1, 2)
        return F.mish(h) * mask


class CausalResnetBlock(nn.Module):
    """``block2(block1(x) + mlp(t_emb)) + res_conv(x * mask)``; ``[B, Cin, T] -> [B, Cout, T]``."""

    def __init__(self, dim: int, dim_out: int, time_emb_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = CausalBlock(dim, dim_out)
        self.block2 = CausalBlock(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: Tensor, mask: Tensor, t_emb: Tensor) -> Tensor:
        h = self.block1(x, mask) + self.mlp(t_emb).unsqueeze(-1)
        h = self.block2(h, mask)
        return h + self.res_conv(x * mask)


class Downsample(nn.Module):
    """Matcha ``Downsample1D``: conv kernel 3, stride 2, padding 1 (``T -> ceil(T/2)``)."""

    def __init__(self, dim: int):
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, 3, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class Upsample(nn.Module):
    """Matcha ``Upsample1D`` (transposed conv kernel 4, stride 2, padding 1: ``T -> 2T``)."""

    def __init__(self, dim: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(dim, dim, 4, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class SelfAttention(nn.Module):
    """diffusers ``Attention`` (self-attention only) on ``[B, T, dim]`` with an additive bias."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        """``x [B, T, dim]``, ``bias [B, 1, T, T]`` (0 or -1e10) -> ``[B, T, dim]``."""
        b, t, _ = x.shape
        q = self.to_q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.to_k(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = self.to_v(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.to_out[0](out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class GeluProjection(nn.Module):
    """diffusers ``GELU``: ``gelu(proj(x))`` (exact erf GELU)."""

    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x))


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
        x = x + self.attn1(self.norm1(x), bias)
        return x + self.ff(self.norm3(x))


@dataclass
class AttentionPlan:
    """Per-U-Net-level masks, computed once per solve and reused by every Euler step.

    ``masks[d]``: ``[B, 1, T_d]`` padding mask (model dtype, 1 valid / 0 padded) at level
    ``d`` (``T_0 = T``, ``T_{d+1} = ceil(T_d / 2)``); ``biases[d]``: ``[B, 1, T_d, T_d]``
    additive attention bias (0 allowed, -1e10 masked).
    """

    masks: list[Tensor]
    biases: list[Tensor]


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
        # upstream's -1e10 overflows float16 (to -inf there); the most negative finite value
        # gives the same exactly-zero attention weight
        masked_value = max(_MASK_BIAS, torch.finfo(mask.dtype).min)
        masks, biases = [], []
        m = mask
        for _ in range(self.depth):
            allowed = chunk_attention_mask(m[:, 0].bool(), streaming, self.cfg.static_chunk_size)
            bias = torch.zeros(allowed.shape, dtype=m.dtype, device=m.device).masked_fill_(~allowed, masked_value)
            masks.append(m)
            biases.append(bias.unsqueeze(1))
            m = m[:, :, ::2]
        return AttentionPlan(masks, biases)

    def _transformers(self, blocks: nn.ModuleList, x: Tensor, bias: Tensor) -> Tensor:
        if len(blocks) == 0:
            return x
        h = x.transpose(1, 2)
        for block in blocks:
            h = block(h, bias)
        return h.transpose(1, 2)

    def forward_planned(self, x: Tensor, plan: AttentionPlan, mu: Tensor, t: Tensor, spks: Tensor,
                        cond: Tensor) -> Tensor:
        """Velocity ``[B, out_channels, T]`` (masked) from a precomputed :class:`AttentionPlan`.

        ``x``, ``mu``, ``cond``: ``[B, n_mels, T]``; ``spks``: ``[B, n_mels]``; ``t``: ``[B]``
        flow time in [0, 1]; all in the model dtype. No host synchronisation.
        """
        t_emb = self.time_mlp(sinusoidal_time_embedding(t, self.cfg.in_channels))
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.size(-1)), cond], dim=1)
        skips = []
        for level, (resnet, blocks, down) in enumerate(self.down_blocks):
            m = plan.masks[level]
            h = resnet(h, m, t_emb)
            h = self._transformers(blocks, h, plan.biases[level])
            skips.append(h)
            h = down(h * m)
        bottom = self.depth - 1
        for resnet, blocks in self.mid_blocks:
            h = resnet(h, plan.masks[bottom], t_emb)
            h = self._transformers(blocks, h, plan.biases[bottom])
        for k, (resnet, blocks, up) in enumerate(self.up_blocks):
            level = bottom - k
            m = plan.masks[level]
            skip = skips.pop()
            h = torch.cat([h[:, :, : skip.size(-1)], skip], dim=1)
            h = resnet(h, m, t_emb)
            h = self._transformers(blocks, h, plan.biases[level])
            h = up(h * m)
        m0 = plan.masks[0]
        h = self.final_block(h, m0)
        return self.final_proj(h * m0) * m0

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                streaming: Tensor | bool = False) -> Tensor:
        """Upstream-compatible call: ``x, mu, cond [B, n_mels, T]``, ``mask [B, 1, T]``
        (1 valid / 0 padded), ``t [B]``, ``spks [B, n_mels]``, ``streaming`` bool or ``[B]``
        bool. Returns the velocity ``[B, out_channels, T]``, zero at padded frames."""
        return self.forward_planned(x, self.attention_plan(mask, streaming), mu, t, spks, cond)
