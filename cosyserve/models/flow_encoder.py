"""Token encoder of the CosyVoice2 flow model: conformer, 2x (token_mel_ratio) upsampling, conformer.

Algorithm source: CosyVoice commit ace7c47, ``cosyvoice/transformer/upsample_encoder.py``
(``UpsampleConformerEncoder``, ``PreLookaheadLayer``, ``Upsample1D``) with the building
blocks ``encoder_layer.ConformerEncoderLayer`` (no macaron feed-forward, no convolution
module, pre-norm), ``attention.RelPositionMultiHeadedAttention``,
``embedding.EspnetRelPositionalEncoding``, ``subsampling.LinearNoSubsampling`` and
``positionwise_feed_forward.PositionwiseFeedForward``. This is an independent, batched
re-implementation: module attribute names follow upstream only so that ``state_dict()``
keys equal those of the official ``flow.pt`` (``encoder.*``).

Data flow for one utterance of ``L`` speech tokens (25 tokens/s) whose embeddings are
``x [L, D]``:

1. ``embed``: Linear -> LayerNorm(eps 1e-5) -> multiply by sqrt(D).
2. ``pre_lookahead_layer``: conv over ``[t, t + pre_lookahead_len]`` (look-ahead) then a
   causal kernel-3 conv, residual. In a *non-final* streaming chunk the last
   ``pre_lookahead_len`` tokens are look-ahead context only: the encoder sequence is the
   first ``T = L - pre_lookahead_len`` tokens and the context tokens are only read by this
   convolution. Otherwise ``T = L`` and the look-ahead reads zeros past the end.
3. ``encoders``: ``num_blocks`` conformer layers over ``T`` positions with relative
   positional self-attention; key padding mask, plus a chunk-causal mask with chunks of
   ``static_chunk_size`` positions (counted from position 0 = first prompt token) when
   the utterance is decoded in streaming mode.
4. ``up_layer``: nearest-neighbour repeat by ``upsample_stride`` (= token_mel_ratio), left
   pad by ``2 * stride`` zeros, conv of kernel ``2 * stride + 1`` (causal). ``T' = stride * T``
   positions, i.e. mel frames at 50 frames/s.
5. ``up_embed`` (Linear -> LayerNorm -> sqrt(D)), ``num_up_blocks`` conformer layers
   (chunk size ``stride * static_chunk_size`` in streaming mode), final LayerNorm.

Batching: items are right-padded. Everything that could let padding reach valid positions
is neutralised: the embedded tokens are zeroed past each item's token count before the
look-ahead convolution (upstream, single item, pads with true zeros there, *after* the
LayerNorm that would otherwise make zero embeddings non-zero), attention masks padded keys
per item, the upsampling convolution is causal and every other operation is position-wise.

Deviation from upstream (documented, no numerical effect for the real model):
upstream builds ``pre_lookahead_layer`` and ``up_layer`` with a literal 512 channels; here
they are sized from ``EncoderConfig.output_size`` (512 in CosyVoice2-0.5B). The look-ahead
length is ``EncoderConfig.pre_lookahead_len`` (literal 3 upstream, 3 in the config) and the
upsample stride ``EncoderConfig.upsample_stride`` (literal 2 upstream, = token_mel_ratio).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from .config import EncoderConfig
from .transfer import to_device

_ACTIVATIONS = {"swish": nn.SiLU, "relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


def relative_position_table(size: int, d_model: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """ESPnet relative sinusoidal table for ``size`` positions.

    Returns ``[1, 2 * size - 1, d_model]`` of ``dtype``; row ``m`` encodes the relative
    distance ``size - 1 - m`` (query index minus key index), i.e. rows run from
    ``+(size-1)`` down to ``-(size-1)``. Even channels hold ``sin(r * w_k)``, odd channels
    ``cos(r * w_k)`` with ``w_k = exp(-2k * ln(10000) / d_model)``, evaluated in float32 as
    ``EspnetRelPositionalEncoding.extend_pe`` does (its precomputed table is sliced to the
    same rows; the values do not depend on the table's ``max_len``).
    """
    rel = torch.arange(size - 1, -size, -1, device=device, dtype=torch.float32).unsqueeze(1)
    inv_freq = torch.exp(
        torch.arange(0, d_model, 2, device=device, dtype=torch.float32) * -(math.log(10000.0) / d_model)
    )
    angles = rel * inv_freq
    table = torch.empty(2 * size - 1, d_model, device=device, dtype=torch.float32)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table.unsqueeze(0).to(dtype)


def chunk_attention_mask(key_valid: Tensor, streaming: Tensor, chunk: int) -> Tensor:
    """Per-item boolean self-attention mask ``[B, T, T]`` (True = may attend).

    ``key_valid`` ``[B, T]`` bool marks each item's valid (non-padded) positions; padded
    keys are masked. For items with ``streaming[b]`` True and ``chunk > 0``, query ``i``
    may in addition only see keys ``j < (i // chunk + 1) * chunk`` (upstream
    ``subsequent_chunk_mask`` with all left chunks, chunks counted from position 0).
    No row is ever all-False when every item has a valid position 0, so upstream's
    "force all-False rows to True" fix-up never applies.
    """
    size = key_valid.size(1)
    allowed = key_valid.unsqueeze(1)  # [B, 1, T]
    if chunk > 0:
        pos = torch.arange(size, device=key_valid.device)
        chunk_end = (torch.div(pos, chunk, rounding_mode="floor") + 1) * chunk
        causal = pos.unsqueeze(0) < chunk_end.unsqueeze(1)  # [T, T]
        return allowed & (causal.unsqueeze(0) | ~streaming.view(-1, 1, 1))
    return allowed.expand(-1, size, -1)


def _prefix_mask(lengths: Tensor, size: int) -> Tensor:
    """``[B, size]`` bool, True at positions ``< lengths[b]``."""
    return torch.arange(size, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


class LinearInputLayer(nn.Module):
    """``LinearNoSubsampling`` + ``EspnetRelPositionalEncoding`` scaling.

    ``[B, T, idim] -> [B, T, odim]``: Linear, LayerNorm(eps 1e-5), times ``sqrt(odim)``.
    (Upstream's dropouts are inference no-ops; the positional table is produced
    separately by :func:`relative_position_table`.)
    """

    def __init__(self, idim: int, odim: int):
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5))
        self.xscale = math.sqrt(odim)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(x) * self.xscale


class RelPositionSelfAttention(nn.Module):
    """Transformer-XL style self-attention with relative positions (ESPnet variant).

    score(i, j) = ((q_i + u) . k_j + (q_i + v) . p_{i-j}) / sqrt(d_k), where ``p`` are
    the projected rows of :func:`relative_position_table`. The positional term and the
    mask are folded into one additive bias and the rest runs in
    ``F.scaled_dot_product_attention`` (masked keys get ``-inf``, i.e. exactly zero weight,
    as upstream's masked_fill before/after softmax).
    """

    def __init__(self, n_head: int, n_feat: int, key_bias: bool = True):
        super().__init__()
        if n_feat % n_head:
            raise ConfigError(f"flow encoder: output_size {n_feat} is not divisible by attention_heads {n_head}")
        self.h = n_head
        self.d_k = n_feat // n_head
        # learnable biases u, v of Transformer-XL section 3.3 (values come from flow.pt)
        self.pos_bias_u = nn.Parameter(torch.zeros(self.h, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(self.h, self.d_k))
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat, bias=key_bias)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)

    @staticmethod
    def _shift(scores: Tensor, n_keys: int | None = None) -> Tensor:
        """ESPnet's rel-shift: ``[..., T, R]`` (column m = distance T-1-m) -> ``[..., T, S]`` (column
        j = key j), ``out[i, j] = scores[i, T - 1 - i + j]``; ``S = n_keys`` (default T; a query
        ``i`` at position ``S - T + i`` after ``S - T`` cached keys, as Step-Audio2's streaming encoder
        computes it, needs ``R >= 2S - 1``). Zero-copy strided view of the contiguous scores.
        """
        scores = scores.contiguous()
        t = scores.size(-2)
        s = t if n_keys is None else n_keys
        st = scores.stride()
        return scores.as_strided(
            scores.shape[:-1] + (s,),
            st[:-2] + (st[-2] - 1, 1),
            scores.storage_offset() + t - 1,
        )

    def _project(self, x: Tensor, pos_table: Tensor):
        """``x [B, T, F]``, ``pos_table [1, R, F]`` -> ``(q + pos_bias_u, q + pos_bias_v)`` ``[B, H, T, dk]``,
        ``k, v [B, H, T, dk]``, the projected table ``p [1, H, R, dk]`` and the score scale."""
        b, t, _ = x.shape
        q = self.linear_q(x).view(b, t, self.h, self.d_k)
        k = self.linear_k(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos_table).view(1, -1, self.h, self.d_k).transpose(1, 2)
        q_u = (q + self.pos_bias_u).transpose(1, 2)
        q_v = (q + self.pos_bias_v).transpose(1, 2)
        return q_u, q_v, k, v, p, 1.0 / math.sqrt(self.d_k)

    def forward(self, x: Tensor, pos_table: Tensor, allowed: Tensor) -> Tensor:
        """``x [B, T, F]``, ``pos_table [1, 2T-1, F]``, ``allowed [B, T, T]`` bool -> ``[B, T, F]``."""
        b, t, _ = x.shape
        q_u, q_v, k, v, p, scale = self._project(x, pos_table)
        pos_scores = self._shift(torch.matmul(q_v, p.transpose(-2, -1))) * scale  # [B, H, T, T]
        bias = pos_scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        out = F.scaled_dot_product_attention(q_u, k, v, attn_mask=bias, scale=scale)
        return self.linear_out(out.transpose(1, 2).reshape(b, t, self.h * self.d_k))

    def forward_cached(self, x: Tensor, pos_table: Tensor, allowed: Tensor, rel_index: Tensor,
                       k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`forward` for ``T`` new positions of each item after ``S`` cached ones.

        ``x [B, T, F]``; ``pos_table [1, 2K-1, F]`` (:func:`relative_position_table` of ``K``
        positions, ``K`` >= every item's cached + new positions); ``allowed [B, T, S + T]`` bool
        over the keys ``[cache | new]``; ``rel_index [B, T, S + T]`` int64: the table row of each
        (query, key) pair, ``K - 1 - (query position - key position)`` (any valid row where not
        allowed); ``k_cache, v_cache [B, H, S, d_k]``. Returns ``(out [B, T, F], k, v)`` with the
        new positions' keys/values ``[B, H, T, d_k]``. The position term is gathered per pair
        instead of ESPnet's rel-shift: the same products."""
        b, t, _ = x.shape
        q_u, q_v, k, v, p, scale = self._project(x, pos_table)
        scores = torch.matmul(q_v, p.transpose(-2, -1))  # [B, H, T, 2K-1]
        pos_scores = scores.gather(-1, rel_index.unsqueeze(1).expand(-1, self.h, -1, -1)) * scale
        bias = pos_scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        out = F.scaled_dot_product_attention(q_u, torch.cat([k_cache, k], 2), torch.cat([v_cache, v], 2),
                                             attn_mask=bias, scale=scale)
        return self.linear_out(out.transpose(1, 2).reshape(b, t, self.h * self.d_k)), k, v

    def forward_after_cache(self, x: Tensor, pos_table: Tensor, kv_cache: Tensor | None,
                            bias_mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """Attention of ``x [B, T, F]`` over ``kv_cache ++ x`` (Step-Audio2's streaming encoder).

        ``kv_cache [B, H, C, 2 d_k]`` keys ‖ values left-aligned to a common end (oldest first) or
        None; ``pos_table [1, 2(C+T)-1, F]``; ``bias_mask [B, 1, T, C+T]`` bool (False = masked) or
        None. Query ``i`` sits at position ``C + i``: the positional score of key ``j`` is column
        ``T - 1 - i + j`` of ``q_v . p`` (:meth:`_shift` with ``C + T`` keys, as upstream computes
        it). Returns ``(out [B, T, F], new keys ‖ values [B, H, C+T, 2 d_k])``. :meth:`forward_cached`
        is the CosyVoice2 form (per-pair table rows, separate K/V caches)."""
        b, t, _ = x.shape
        q_u, q_v, k, v, p, scale = self._project(x, pos_table)
        if kv_cache is not None and kv_cache.size(2) > 0:
            kc, vc = kv_cache.split(self.d_k, dim=-1)
            k = torch.cat([kc, k], dim=2)
            v = torch.cat([vc, v], dim=2)
        new_kv = torch.cat([k, v], dim=-1)
        bias = self._shift(torch.matmul(q_v, p.transpose(-2, -1)), k.size(2)) * scale
        if bias_mask is not None:
            bias = bias.masked_fill(~bias_mask, float("-inf"))
        out = F.scaled_dot_product_attention(q_u, k, v, attn_mask=bias, scale=scale)
        return self.linear_out(out.transpose(1, 2).reshape(b, t, self.h * self.d_k)), new_kv


class PositionwiseFeedForward(nn.Module):
    """``w_2(act(w_1(x)))`` applied per position."""

    def __init__(self, idim: int, hidden: int, activation: str):
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden)
        self.activation = _ACTIVATIONS[activation]()
        self.w_2 = nn.Linear(hidden, idim)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(self.activation(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-norm block as CosyVoice2 configures ``ConformerEncoderLayer``.

    ``x + MHA(LN(x))`` then ``x + FFN(LN(x))``, both LayerNorms with eps 1e-12.
    """

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d = cfg.output_size
        self.self_attn = RelPositionSelfAttention(cfg.attention_heads, d, cfg.key_bias)
        self.feed_forward = PositionwiseFeedForward(d, cfg.linear_units, cfg.activation)
        self.norm_ff = nn.LayerNorm(d, eps=1e-12)
        self.norm_mha = nn.LayerNorm(d, eps=1e-12)

    def forward(self, x: Tensor, pos_table: Tensor, allowed: Tensor) -> Tensor:
        x = x + self.self_attn(self.norm_mha(x), pos_table, allowed)
        return x + self.feed_forward(self.norm_ff(x))

    def forward_cached(self, x: Tensor, pos_table: Tensor, allowed: Tensor, rel_index: Tensor,
                       k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`forward` of new positions after cached ones (see
        :meth:`RelPositionSelfAttention.forward_cached`); returns ``(out, k, v)``."""
        a, k, v = self.self_attn.forward_cached(self.norm_mha(x), pos_table, allowed, rel_index, k_cache, v_cache)
        x = x + a
        return x + self.feed_forward(self.norm_ff(x)), k, v


class PreLookaheadLayer(nn.Module):
    """Look-ahead convolution (kernel ``lookahead + 1`` over ``[t, t + lookahead]``),
    LeakyReLU(0.01), causal kernel-3 convolution, residual.

    Input ``[B, T_in, C]`` whose positions past each item's encoder length already hold
    either its look-ahead context (non-final chunk) or zeros; ``lookahead`` more zeros are
    appended here. Output ``[B, T_in, C]`` (only positions < each item's encoder length
    are meaningful).
    """

    def __init__(self, channels: int, lookahead: int, hidden: int | None = None):
        super().__init__()
        self.lookahead = lookahead
        # ``hidden``: conv1's output / conv2's input channels (CosyVoice3: 80 -> 1024 -> 80);
        # CosyVoice2 keeps ``channels`` throughout
        hidden = channels if hidden is None else hidden
        self.conv1 = nn.Conv1d(channels, hidden, kernel_size=lookahead + 1)
        self.conv2 = nn.Conv1d(hidden, channels, kernel_size=3)

    def forward(self, x: Tensor) -> Tensor:
        h = F.pad(x.transpose(1, 2), (0, self.lookahead))
        h = F.leaky_relu(self.conv1(h))
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))
        return h.transpose(1, 2) + x


class RepeatUpsample(nn.Module):
    """Nearest-neighbour upsampling by ``stride`` followed by a causal conv (kernel ``2*stride+1``).

    ``[B, C, T] -> [B, C, stride * T]``; output frame ``t`` depends on input frames
    ``<= t // stride`` only.
    """

    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, 2 * stride + 1)

    def forward(self, x: Tensor) -> Tensor:
        x = F.interpolate(x, scale_factor=float(self.stride), mode="nearest")
        return self.conv(F.pad(x, (2 * self.stride, 0)))


@dataclass
class EncoderStreamCache:
    """One stream's exactly reusable encoder work (issue 17): the first :attr:`tokens` encoder
    positions (a whole number of ``static_chunk_size`` chunks, prompt included) and their
    ``upsample_stride`` x as many frames, as later streaming calls of the stream need them.

    In streaming mode a position in a complete chunk reads only positions of complete chunks
    (chunk-causal attention), its look-ahead convolution reads ``pre_lookahead_len`` tokens
    that a non-final call already holds, and the causal upsampling reads earlier positions only;
    so all of it is unchanged when tokens are appended.

    Attributes (model dtype/device), position-major so that a batch gathers every stream's cache with
    one copy and hands out the grown caches as one split: ``keys``/``values``: ``[tokens, n_layers, H,
    d_k]`` every first-stage conformer layer's keys/values; ``up_keys``/``up_values``: ``[stride *
    tokens, n_up_layers, H, d_k]`` the up-conformer layers'; ``context``: ``[2, D]`` first-stage
    outputs of positions ``tokens - 2, tokens - 1`` (the upsampling convolution's left context); None
    while empty. :meth:`clear` frees them.
    """

    tokens: int = 0
    keys: Tensor | None = None
    values: Tensor | None = None
    up_keys: Tensor | None = None
    up_values: Tensor | None = None
    context: Tensor | None = None

    def clear(self) -> None:
        """Drop every tensor (``tokens`` = 0)."""
        self.tokens = 0
        self.keys = self.values = self.up_keys = self.up_values = self.context = None

    def nbytes(self) -> int:
        """Bytes held by the cached tensors (views count with their own extent)."""
        ts = [t for t in (self.keys, self.values, self.up_keys, self.up_values, self.context) if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)


def segment_index(rows: list[int], lengths: list[int], offsets: list[int]) -> tuple[Tensor, Tensor]:
    """CPU int64 index pair ``(row [N], pos [N])``, ``N = sum(lengths)``: segment ``k`` is ``lengths[k]``
    entries of row ``rows[k]`` at positions ``offsets[k], offsets[k] + 1, ...`` (segments in order).
    Built with a few tensor operations whatever the number of segments (no per-segment Python work
    on tensors): the indices of the batched gathers / indexed copies of the stream caches (the caller
    moves them to the device, one transfer). ``rows``, ``lengths``, ``offsets``: equally long lists of
    Python ints, ``lengths`` >= 0; raises ValueError otherwise."""
    if not (len(rows) == len(lengths) == len(offsets)) or any(n < 0 for n in lengths):
        raise ValueError(f"segment_index: {len(rows)} rows, {len(lengths)} lengths (>= 0), {len(offsets)} offsets")
    n = torch.tensor(lengths, dtype=torch.long)
    row = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), n, output_size=sum(lengths))
    shift = torch.tensor(offsets, dtype=torch.long) - (torch.cumsum(n, 0) - n)
    pos = torch.arange(sum(lengths), dtype=torch.long) + torch.repeat_interleave(shift, n, output_size=sum(lengths))
    return row, pos


def segment_index_on(device, rows: list[int], lengths: list[int], offsets: list[int]) -> tuple[Tensor, Tensor]:
    """:func:`segment_index` on ``device`` (both tensors moved in one transfer)."""
    return to_device(torch.stack(segment_index(rows, lengths, offsets)), device).unbind(0)


def _stream_masks(starts: Tensor, new: Tensor, s_max: int, t_new: int, k_tab: int, streaming: Tensor, chunk: int):
    """``(allowed [B, T, S + T] bool, rel_index [B, T, S + T] int64)`` for new positions
    ``starts[b] + i`` (``i < new[b]``) attending to cached positions ``j < starts[b]`` (padded to
    ``S``) and new ones (chunk-causal for streaming items, chunks from position 0); ``k_tab`` >=
    every ``starts[b] + new[b]``: the relative-position table's size."""
    device = starts.device
    i = torch.arange(t_new, device=device).view(1, -1)
    q_abs = starts.view(-1, 1) + i                                            # [B, T]
    j = torch.arange(s_max, device=device).view(1, -1)
    k_abs = torch.cat([j.expand(starts.numel(), -1), q_abs], dim=1)           # [B, S + T]
    k_ok = torch.cat([j < starts.view(-1, 1), i < new.view(-1, 1)], dim=1)    # [B, S + T]
    allowed = k_ok.unsqueeze(1).expand(-1, t_new, -1)
    if chunk > 0:
        chunk_end = (torch.div(q_abs, chunk, rounding_mode="floor") + 1) * chunk
        causal = k_abs.unsqueeze(1) < chunk_end.unsqueeze(2)
        allowed = allowed & (causal | ~streaming.view(-1, 1, 1))
    rel = q_abs.unsqueeze(2) - k_abs.unsqueeze(1)
    return allowed, (k_tab - 1 - rel).clamp(0, 2 * k_tab - 2)


class UpsampleConformerEncoder(nn.Module):
    """Speech-token embeddings -> hidden states at the mel frame rate.

    See the module docstring for the algorithm. Built from :class:`EncoderConfig`;
    raises :class:`~cosyserve.errors.ConfigError` if ``input_size != output_size``
    (upstream feeds the ``output_size``-wide upsampled states into ``up_embed``, whose
    Linear is ``input_size`` wide) or the activation is unknown.
    """

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        if cfg.input_size != cfg.output_size:
            raise ConfigError(
                f"flow encoder: input_size {cfg.input_size} must equal output_size {cfg.output_size} "
                "(the upsampled states re-enter a Linear of width input_size)"
            )
        if cfg.activation not in _ACTIVATIONS:
            raise ConfigError(f"flow encoder: activation {cfg.activation!r} unsupported")
        self.cfg = cfg
        d = cfg.output_size
        self.embed = LinearInputLayer(cfg.input_size, d)
        self.after_norm = nn.LayerNorm(d, eps=1e-5)
        self.pre_lookahead_layer = PreLookaheadLayer(d, cfg.pre_lookahead_len)
        self.encoders = nn.ModuleList(ConformerLayer(cfg) for _ in range(cfg.num_blocks))
        self.up_layer = RepeatUpsample(d, cfg.upsample_stride)
        self.up_embed = LinearInputLayer(cfg.input_size, d)
        self.up_encoders = nn.ModuleList(ConformerLayer(cfg) for _ in range(cfg.num_up_blocks))

    @property
    def output_size(self) -> int:
        return self.cfg.output_size

    def forward(self, tokens: Tensor, token_lengths: Tensor, lengths: Tensor, streaming: Tensor,
                max_length: int) -> Tensor:
        """Encode a right-padded batch.

        Args:
            tokens: ``[B, L_max, input_size]`` token embeddings (model dtype), zero past
                each item's token count.
            token_lengths: ``[B]`` int64, tokens per item including look-ahead context.
            lengths: ``[B]`` int64, encoder positions per item (``token_lengths`` minus
                ``pre_lookahead_len`` for non-final streaming chunks), each >= 1.
            streaming: ``[B]`` bool, chunk-causal attention per item.
            max_length: ``int(lengths.max())``, passed by the caller to avoid a host sync.

        Returns:
            ``[B, stride * max_length, output_size]`` after the final LayerNorm; item ``b``
            is valid for its first ``stride * lengths[b]`` positions (mel frames).
        """
        stride = self.cfg.upsample_stride
        x = self.embed(tokens)
        # zero past each item's tokens: upstream (one item) pads with zeros *after* the LayerNorm
        keep = _prefix_mask(token_lengths, x.size(1))
        x = torch.where(keep.unsqueeze(-1), x, x.new_zeros(()))
        x = self.pre_lookahead_layer(x)[:, :max_length]

        allowed = chunk_attention_mask(_prefix_mask(lengths, max_length), streaming, self.cfg.static_chunk_size)
        pos = relative_position_table(max_length, self.output_size, x.device, x.dtype)
        for layer in self.encoders:
            x = layer(x, pos, allowed)

        x = self.up_layer(x.transpose(1, 2)).transpose(1, 2)
        up_len = stride * max_length
        x = self.up_embed(x)
        allowed = chunk_attention_mask(
            _prefix_mask(lengths * stride, up_len), streaming, self.cfg.static_chunk_size * stride
        )
        pos = relative_position_table(up_len, self.output_size, x.device, x.dtype)
        for layer in self.up_encoders:
            x = layer(x, pos, allowed)
        return self.after_norm(x)

    #: first-stage positions of left context the causal upsampling convolution reads
    UP_CONTEXT = 2

    def forward_stream(self, tokens: Tensor, token_lengths: Tensor, lengths: list[int], streaming: list[bool],
                       starts: list[int], caches: list, commit: list[int]) -> Tensor:
        """:meth:`forward` of the positions from ``starts[b]`` on, the earlier ones from stream caches.

        Args: ``tokens [B, L_max, input_size]``, ``token_lengths [B]`` as :meth:`forward`;
        ``lengths``, ``streaming``: host lists (encoder positions, chunk-causal flag per item);
        ``starts[b]``: cached positions used (``caches[b].tokens`` or 0; a multiple of
        ``static_chunk_size``); ``caches[b]``: :class:`EncoderStreamCache` or None;
        ``commit[b]``: positions the cache holds afterwards (``> starts[b]``: the positions
        ``[starts[b], commit[b])`` are appended; a multiple of ``static_chunk_size`` within
        this call's complete chunks). Look-ahead embedding and convolution still run over every
        token (position-wise, ~5 % of the encoder).

        Returns ``[B, stride * T, output_size]`` with ``T = max(lengths[b] - starts[b])``: item
        ``b``'s frames ``stride * starts[b] ...``, valid for ``stride * (lengths[b] - starts[b])``.
        Equal (up to summation order) to the same frames of :meth:`forward`.
        """
        stride = self.cfg.upsample_stride
        device = tokens.device
        b_n = tokens.size(0)
        new = [n - s for n, s in zip(lengths, starts)]
        t_new, s_max = max(new), max(starts)
        x = self.embed(tokens)
        keep = _prefix_mask(token_lengths, x.size(1))
        x = torch.where(keep.unsqueeze(-1), x, x.new_zeros(()))
        x = self.pre_lookahead_layer(x)
        # every item's new positions, left-aligned: one gather + one indexed copy for the batch
        xn = x.new_zeros(b_n, t_new, x.size(-1))
        if sum(new) > 0:
            row, src = segment_index(list(range(b_n)), new, starts)
            _, dst = segment_index(list(range(b_n)), new, [0] * b_n)
            row, src, dst = to_device(torch.stack([row, src, dst]), device).unbind(0)
            xn.index_put_((row, dst), x[row, src])
        start_t = to_device(torch.tensor(starts), device)
        new_t = to_device(torch.tensor(new), device)
        stream_t = to_device(torch.tensor(streaming, dtype=torch.bool), device)
        cached = [b for b, c in enumerate(caches) if c is not None and starts[b] > 0]
        grown = [b for b, c in enumerate(caches) if c is not None and commit[b] > starts[b]]

        def stage(layers, h, scale, attr_k, attr_v):
            k_tab = scale * max(s + m for s, m in zip(starts, new))
            allowed, rel_index = _stream_masks(start_t * scale, new_t * scale, s_max * scale, t_new * scale, k_tab,
                                               stream_t, self.cfg.static_chunk_size * scale)
            pos = relative_position_table(k_tab, self.output_size, device, h.dtype)
            if len(layers) == 0:
                return h
            att = layers[0].self_attn
            # all layers' cached keys/values of all items: [layers, B, H, S, d_k], one copy per kind
            kc = h.new_zeros(len(layers), b_n, att.h, s_max * scale, att.d_k)
            vc = torch.zeros_like(kc)
            if cached:
                row, at = segment_index_on(device, cached, [starts[b] * scale for b in cached], [0] * len(cached))
                kc[:, row, :, at] = torch.cat([getattr(caches[b], attr_k) for b in cached])
                vc[:, row, :, at] = torch.cat([getattr(caches[b], attr_v) for b in cached])
            out_k, out_v = [], []
            for li, layer in enumerate(layers):
                h, k, v = layer.forward_cached(h, pos, allowed, rel_index, kc[li], vc[li])
                out_k.append(k)
                out_v.append(v)
            if grown:  # the grown caches: [cached | new] positions of each growing item, one gather per kind
                sizes = [commit[b] * scale for b in grown]
                rows, lens, offs = [], [], []
                for b in grown:  # host ints only: the cached part, then the new part after the padded cache
                    rows += [b, b]
                    lens += [starts[b] * scale, (commit[b] - starts[b]) * scale]
                    offs += [0, s_max * scale]
                row, at = segment_index_on(device, rows, lens, offs)
                for kind, cache, new_kv in ((attr_k, kc, out_k), (attr_v, vc, out_v)):
                    full = torch.cat([cache, torch.stack(new_kv)], dim=3)  # [layers, B, H, S + T, d_k]
                    for b, part in zip(grown, full[:, row, :, at].split(sizes)):  # [c_b, layers, H, d_k]
                        setattr(caches[b], kind, part.clone())  # own storage: no stream keeps the batch's alive
            return h

        xn = stage(self.encoders, xn, 1, "keys", "values")
        ctx_n = self.UP_CONTEXT
        ctx = xn.new_zeros(b_n, ctx_n, xn.size(-1))
        if cached:
            ctx.index_copy_(0, to_device(torch.tensor(cached), device),
                            torch.stack([caches[b].context for b in cached]))
        ext = torch.cat([ctx, xn], dim=1)
        if grown:  # each growing item's first-stage outputs just before its new cache end
            row, at = segment_index_on(device, grown, [ctx_n] * len(grown), [commit[b] - starts[b] for b in grown])
            for b, c in zip(grown, ext[row, at].view(len(grown), ctx_n, -1).unbind(0)):
                caches[b].context = c.clone()
        up = self.up_layer(ext.transpose(1, 2)).transpose(1, 2)[:, stride * ctx_n:]
        up = self.up_embed(up)
        up = stage(self.up_encoders, up, stride, "up_keys", "up_values")
        for b in grown:
            caches[b].tokens = commit[b]
        return self.after_norm(up)
