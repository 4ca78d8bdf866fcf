"""CosyVoice3 flow model: speech tokens (25/s) -> 80-bin natural-log mel (50 frames/s).

Algorithm source: CosyVoice commit ace7c47, ``cosyvoice/flow/flow.py``
(``CausalMaskedDiffWithDiT.inference``), ``cosyvoice/flow/flow_matching.py``
(``CausalConditionalCFM``, shared with CosyVoice2), ``cosyvoice/flow/DiT/dit.py`` and
``cosyvoice/flow/DiT/modules.py`` (the F5-TTS style DiT), ``cosyvoice/transformer/upsample_encoder.py``
(``PreLookaheadLayer``) and x-transformers 2.11.24 (``RotaryEmbedding``, ``apply_rotary_pos_emb``).
Independent plain-torch re-implementation; ``CV3FlowModel.state_dict()`` has exactly the keys and
shapes of the official CosyVoice3 ``flow.pt`` (module names follow upstream for that reason only).

Per utterance (upstream semantics; differences from CosyVoice2 in *italics*):

1. ``spks = spk_embed_affine_layer(l2_normalize(embedding))`` -> ``[n_mels]``.
2. Tokens ``[prompt_token, token]`` (``L = P + N``) are embedded (ids clamped at 0). *There is no
   conformer encoder*: the embeddings go through ``pre_lookahead_layer`` only (look-ahead conv of
   kernel ``pre_lookahead_len + 1`` to ``pre_lookahead_channels``, LeakyReLU, causal kernel-3 conv
   back, residual; with ``finalize=False`` the last ``pre_lookahead_len`` tokens are right context
   only), are repeated ``token_mel_ratio`` times along time and, transposed, are ``mu``
   ``[1, n_mels, T]`` (``T = ratio * (L - (0 if finalize else 3))``).
3. ``cond``: prompt mel in the first ``F`` frames, zeros after.
4. The CFM solver of :class:`~cosyserve.models.flow.CausalFlowMatching` (fixed noise
   ``set_all_random_seed(0); randn(1, 80, 15000)``, cosine schedule, 10 Euler steps, CFG 0.7 as
   one batch of 2B) *with the DiT velocity estimator* :class:`DiT`.
5. The prompt frames are dropped; float32 out.

DiT (``[B, T, 4 * n_mels]`` packed ``[x | mu | spks | cond]`` -> velocity ``[B, T, n_mels]``):
``h = proj(cat(x, cond, mu, spks))``; ``h += Mish(conv(Mish(conv(h))))`` (two causal grouped
convolutions of kernel 31, 16 groups); ``depth`` blocks of adaLN-zero modulated self-attention
(rotary embedding as x-transformers applies it: the *first* ``dim_head`` channels of the packed
``heads * dim_head`` query/key vectors are rotated, pairs interleaved, i.e. only head 0 gets
positions) and tanh-GELU feed-forward, each gated by the time embedding; final adaLN
(scale, shift) and ``proj_out``. The time embedding is ``time_mlp(sinusoidal_256(1000 t))``.
Attention sees all valid frames offline; in streaming mode a static chunk mask of
``static_chunk_size`` (50) frames (chunk ``i`` sees chunks ``<= i``, counted from frame 0).
Upstream's ``num_decoding_left_chunks`` setting is not used by the DiT (it always passes -1:
all left chunks), so it is parsed but has no effect here either.

Batching: :meth:`CV3FlowModel.inference_batch` (inherited from
:class:`~cosyserve.models.flow.FlowModel`) pads items on the right; padded tokens are zeroed before
the look-ahead conv (upstream pads with zeros), every later convolution is causal, attention masks
padded keys per item, so valid frames equal single-item results up to float summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from .config import CFMConfig, Tagged, _get, _parse_cfm
from .flow import CausalFlowMatching, FlowModel
from .flow_encoder import PreLookaheadLayer, chunk_attention_mask
from .flow_estimator import sinusoidal_time_embedding
from .fused import FusedOp, attention_bias, linear_gelu_tanh, norm_modulate
from .transfer import to_device

__all__ = ["DiTConfig", "CV3FlowConfig", "parse_cv3_flow", "DiT", "DiTPlan", "DiTStreamCache", "DiTCachedPlan",
           "CV3FlowModel", "load_cv3_flow", "rotary_tables"]


# --------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DiTConfig:
    """``cosyvoice.flow.DiT.dit.DiT``: the CosyVoice3 velocity estimator."""

    dim: int
    depth: int
    heads: int
    dim_head: int
    ff_mult: float
    mel_dim: int
    mu_dim: int
    spk_dim: int
    out_channels: int
    static_chunk_size: int
    num_decoding_left_chunks: int
    long_skip_connection: bool = False
    time_freq_dim: int = 256  # TimestepEmbedding(freq_embed_dim=256) upstream
    conv_pos_kernel: int = 31  # CausalConvPositionEmbedding defaults upstream
    conv_pos_groups: int = 16


@dataclass(frozen=True)
class CV3FlowConfig:
    """``CausalMaskedDiffWithDiT``: speech tokens -> 80-bin log-mel at 50 frames/s."""

    input_size: int
    output_size: int
    spk_embed_dim: int
    vocab_size: int
    token_mel_ratio: int
    pre_lookahead_len: int
    pre_lookahead_channels: int
    input_frame_rate: int
    cfm: CFMConfig
    estimator: DiTConfig


def _expect(node, key: str, cls: str) -> dict:
    if not isinstance(node, Tagged) or node.kind != "new":
        raise ConfigError(f"yaml key '{key}' must be '!new:...{cls}', found {node!r:.80}")
    if node.class_name != cls:
        raise ConfigError(f"yaml key '{key}' instantiates {node.target}; cosyserve's CosyVoice3 flow implements {cls}")
    return node.kwargs()


def parse_cv3_flow(data: dict) -> CV3FlowConfig:
    """:class:`CV3FlowConfig` from the whole dict of
    :func:`cosyserve.models.config.load_hyperpyyaml` (``cosyvoice3.yaml``).

    Checks the classes (``flow: CausalMaskedDiffWithDiT``, ``pre_lookahead_layer:
    PreLookaheadLayer``, ``decoder: CausalConditionalCFM``, ``estimator: DiT``) and the sizes
    that must agree. Raises :class:`~cosyserve.errors.ConfigError` naming the offending key.
    """
    flow = _expect(data.get("flow"), "flow", "CausalMaskedDiffWithDiT")
    pre = _expect(flow.get("pre_lookahead_layer"), "flow.pre_lookahead_layer", "PreLookaheadLayer")
    dec = _expect(flow.get("decoder"), "flow.decoder", "CausalConditionalCFM")
    est = _expect(dec.get("estimator"), "flow.decoder.estimator", "DiT")
    w = "flow"
    out_size = _get(flow, "output_size", w, 80, int)
    input_size = _get(flow, "input_size", w, 512, int)
    pre_len = _get(flow, "pre_lookahead_len", w, 3, int)
    ratio = _get(flow, "token_mel_ratio", w, 2, int)

    cfm = _parse_cfm(dec)
    we = "flow.decoder.estimator"
    mel_dim = _get(est, "mel_dim", we, 80, int)
    mu_dim = _get(est, "mu_dim", we, None, int)
    dit = DiTConfig(
        dim=_get(est, "dim", we, conv=int),
        depth=_get(est, "depth", we, 8, int),
        heads=_get(est, "heads", we, 8, int),
        dim_head=_get(est, "dim_head", we, 64, int),
        ff_mult=_get(est, "ff_mult", we, 4, float),
        mel_dim=mel_dim,
        mu_dim=mel_dim if mu_dim is None else mu_dim,
        spk_dim=_get(est, "spk_dim", we, 0, int) or 0,
        out_channels=_get(est, "out_channels", we, mel_dim, int),
        static_chunk_size=_get(est, "static_chunk_size", we, 50, int),
        num_decoding_left_chunks=_get(est, "num_decoding_left_chunks", we, 2, int),
        long_skip_connection=bool(_get(est, "long_skip_connection", we, False)),
    )
    cfg = CV3FlowConfig(
        input_size=input_size,
        output_size=out_size,
        spk_embed_dim=_get(flow, "spk_embed_dim", w, 192, int),
        vocab_size=_get(flow, "vocab_size", w, 4096, int),
        token_mel_ratio=ratio,
        pre_lookahead_len=pre_len,
        pre_lookahead_channels=_get(pre, "channels", "flow.pre_lookahead_layer", conv=int),
        input_frame_rate=_get(flow, "input_frame_rate", w, 50, int),
        cfm=cfm,
        estimator=dit,
    )
    checks = [
        (_get(pre, "in_channels", "flow.pre_lookahead_layer", conv=int) == input_size,
         "flow.pre_lookahead_layer.in_channels must equal flow.input_size"),
        (_get(pre, "pre_lookahead_len", "flow.pre_lookahead_layer", 1, int) == pre_len,
         "flow.pre_lookahead_layer.pre_lookahead_len must equal flow.pre_lookahead_len"),
        (dit.mel_dim == out_size, f"DiT mel_dim {dit.mel_dim} must equal flow.output_size {out_size}"),
        (dit.mu_dim == out_size and input_size == out_size,
         f"DiT mu_dim {dit.mu_dim} and flow.input_size {input_size} must equal flow.output_size {out_size} "
         "(mu is the look-ahead layer's output)"),
        (dit.spk_dim == out_size and cfm.spk_emb_dim == out_size,
         f"DiT spk_dim {dit.spk_dim} / decoder spk_emb_dim {cfm.spk_emb_dim} must equal flow.output_size {out_size}"),
        (dit.dim_head % 2 == 0 and dit.heads >= 1 and dit.depth >= 1,
         "DiT needs an even dim_head, heads >= 1, depth >= 1"),
        (ratio >= 1 and pre_len >= 0, "flow.token_mel_ratio must be >= 1 and pre_lookahead_len >= 0"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(f"yaml: {msg}")
    return cfg


# --------------------------------------------------------------------------------------
# DiT
# --------------------------------------------------------------------------------------


def rotary_tables(inv_freq: Tensor, frames: int) -> tuple[Tensor, Tensor]:
    """x-transformers ``RotaryEmbedding.forward_from_seq_len``: ``(cos, sin)`` ``[frames, dim_head]``
    float32 with each frequency ``pos * inv_freq[k]`` repeated for the interleaved pair
    ``(2k, 2k+1)``."""
    pos = torch.arange(frames, device=inv_freq.device).to(inv_freq.dtype)
    freqs = torch.einsum("i,j->ij", pos, inv_freq)
    freqs = torch.stack((freqs, freqs), dim=-1).flatten(-2).float()
    return freqs.cos(), freqs.sin()


def signed_sin(sin: Tensor) -> Tensor:
    """``sin [..., d]`` with the even channels negated: the sign of x-transformers' interleaved
    ``rotate_half`` (``(x0, x1) -> (-x1, x0)``) moved into the table, so a rotation is
    ``x * cos + swap_pairs(x) * signed_sin`` (same products, same float32 values)."""
    return torch.stack((-sin[..., 0::2], sin[..., 1::2]), dim=-1).flatten(-2)


def _rotary_eager(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (x * cos + swapped * sin_signed).to(x.dtype)


#: one kernel on CUDA (:class:`~cosyserve.models.fused.FusedOp`); eager elsewhere
_ROTARY = FusedOp(_rotary_eager, "cv3_rotary")


def apply_rotary_(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """x-transformers ``apply_rotary_pos_emb`` on ``x [B, T, D]`` **in place** with tables ``cos`` and
    :func:`signed_sin` ``[T, d]`` or ``[B, T, d]`` float32 (``d <= D``): only the first ``d``
    channels are rotated, computed in float32 and stored in ``x.dtype`` (upstream computes the
    rotation in float32 and casts the whole vector back: the other channels are unchanged either
    way). Returns ``x``. On CUDA the rotation is one fused kernel plus the store."""
    d = cos.shape[-1]
    head = x[..., :d]
    head.copy_(_ROTARY(head, cos, sin_signed))
    return x


class _RotaryEmbedding(nn.Module):
    """Holds ``inv_freq`` ``[dim_head / 2]`` (a persistent buffer: in ``flow.pt``), kept float32
    when the model is cast to another dtype (only moved between devices): the rotary angles
    ``pos * inv_freq`` reach thousands of radians, which half precision could not represent."""

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)))

    def _apply(self, fn, recurse=True):
        inv = self.inv_freq
        device = fn(torch.empty(0, dtype=inv.dtype, device=inv.device)).device
        self.inv_freq = inv.to(device=device)
        return self


class _TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, freq_dim: int):
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        return self.time_mlp(sinusoidal_time_embedding(t, self.freq_dim))


class _CausalConvPositionEmbedding(nn.Module):
    def __init__(self, dim: int, kernel: int, groups: int):
        super().__init__()
        self.kernel = kernel
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel, groups=groups), nn.Mish())

    def forward(self, x: Tensor) -> Tensor:
        """``[B, T, D] -> [B, T, D]``; frame ``t`` reads frames ``t - 2 (k - 1) .. t``."""
        h = x.transpose(1, 2)
        h = self.conv1(F.pad(h, (self.kernel - 1, 0)))
        h = self.conv2(F.pad(h, (self.kernel - 1, 0)))
        return h.transpose(1, 2)

    def forward_tail(self, x_ext: Tensor, keep1: Tensor) -> Tensor:
        """:meth:`forward` for the last ``T`` frames of a longer sequence, given ``x_ext [B, 2 (k - 1)
        + T, D]``: the ``2 (k - 1)`` input frames before them (zeros where the sequence has none), then
        theirs. ``keep1 [B, k - 1 + T, 1]`` (model dtype) is 0 where the first conv's output lies
        before the sequence start (there :meth:`forward` pads the second conv's input with zeros)."""
        h = self.conv1(x_ext.transpose(1, 2)) * keep1.transpose(1, 2)
        return self.conv2(h).transpose(1, 2)


class _InputEmbedding(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.mel_dim * 2 + cfg.mu_dim + cfg.spk_dim, cfg.dim)
        self.conv_pos_embed = _CausalConvPositionEmbedding(cfg.dim, cfg.conv_pos_kernel, cfg.conv_pos_groups)

    def forward(self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor) -> Tensor:
        h = self.proj(torch.cat([x, cond, mu, spks], dim=-1))
        return self.conv_pos_embed(h) + h


class _AdaLayerNorm(nn.Module):
    """``linear(silu(t))`` split into ``chunks`` modulation vectors (adaLN-zero)."""

    def __init__(self, dim: int, chunks: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim * chunks)
        self.chunks = chunks

    def forward(self, silu_t: Tensor) -> tuple[Tensor, ...]:
        """``silu_t = silu(time embedding)`` ``[B or 1, 1, D]`` (computed once per DiT evaluation for
        every block) -> ``chunks`` vectors ``[B or 1, 1, D]``."""
        return torch.chunk(self.linear(silu_t), self.chunks, dim=-1)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int):
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Dropout(0.0)])

    def forward(self, x: Tensor, plan: "DiTPlan") -> Tensor:
        b, t, _ = x.shape
        q = apply_rotary_(self.to_q(x), plan.cos, plan.sin_signed)
        k = apply_rotary_(self.to_k(x), plan.cos, plan.sin_signed)
        v = self.to_v(x)
        q, k, v = (y.view(b, t, self.heads, self.dim_head).transpose(1, 2) for y in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.bias)
        o = o.transpose(1, 2).reshape(b, t, self.heads * self.dim_head)
        return self.to_out[0](o) * plan.valid

    def forward_cached(self, x: Tensor, cp: "DiTCachedPlan", k_cache: Tensor | None) -> tuple[Tensor, Tensor]:
        """Attention of new frames ``x [B, T, D]`` over the cached keys/values ``k_cache [2, B, H,
        F, dh]`` (stacked K, V of earlier frames, rotary applied; None when no item has any) and
        their own. Returns the output ``[B, T, D]`` and the new frames' stacked K, V ``[2, B, H, T,
        dh]`` (what a later call reads from the cache)."""
        b, t, _ = x.shape
        q = apply_rotary_(self.to_q(x), cp.cos, cp.sin_signed)
        k = apply_rotary_(self.to_k(x), cp.cos, cp.sin_signed)
        v = self.to_v(x)
        q, k, v = (y.view(b, t, self.heads, self.dim_head).transpose(1, 2) for y in (q, k, v))
        new = torch.stack((k, v))
        if k_cache is not None:
            k, v = torch.cat((k_cache[0], k), dim=2), torch.cat((k_cache[1], v), dim=2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=cp.bias)
        o = o.transpose(1, 2).reshape(b, t, self.heads * self.dim_head)
        return self.to_out[0](o) * cp.valid, new


class _FeedForward(nn.Module):
    def __init__(self, dim: int, mult: float):
        super().__init__()
        inner = int(dim * mult)
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")),
                                nn.Dropout(0.0), nn.Linear(inner, dim))

    def forward(self, x: Tensor) -> Tensor:
        first = self.ff[0][0]
        return self.ff[2](linear_gelu_tanh(x, first.weight, first.bias))


class _DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.attn_norm = _AdaLayerNorm(cfg.dim, 6)
        self.attn = _Attention(cfg.dim, cfg.heads, cfg.dim_head)
        self.ff = _FeedForward(cfg.dim, cfg.ff_mult)

    def forward(self, x: Tensor, silu_t: Tensor, plan: "DiTPlan") -> Tensor:
        """``x [B, T, D]``, ``silu_t`` ``[B or 1, 1, D]`` (silu of the time embedding)."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(silu_t)
        x = torch.addcmul(x, gate_msa, self.attn(norm_modulate(x, shift_msa, scale_msa), plan))
        return torch.addcmul(x, gate_mlp, self.ff(norm_modulate(x, shift_mlp, scale_mlp)))

    def forward_cached(self, x: Tensor, silu_t: Tensor, cp: "DiTCachedPlan",
                       kv: Tensor | None) -> tuple[Tensor, Tensor]:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(silu_t)
        a, new = self.attn.forward_cached(norm_modulate(x, shift_msa, scale_msa), cp, kv)
        x = torch.addcmul(x, gate_msa, a)
        return torch.addcmul(x, gate_mlp, self.ff(norm_modulate(x, shift_mlp, scale_mlp))), new


@dataclass
class DiTPlan:
    """What every Euler step of one solve shares (:meth:`DiT.attention_plan`).

    ``allowed`` ``[B, 1, T, T]`` bool (True = may attend: valid keys, and for streaming rows keys
    in the same or earlier chunks) and ``bias``, the same as an additive mask in the model dtype
    (:func:`attention_bias`); ``valid`` ``[B, T, 1]`` model dtype (1 valid / 0 padded); ``cos`` /
    ``sin`` ``[T, dim_head]`` float32 rotary tables and ``sin_signed`` (:func:`signed_sin`).
    """

    allowed: Tensor
    bias: Tensor
    valid: Tensor
    cos: Tensor
    sin: Tensor
    sin_signed: Tensor


@dataclass
class DiTStreamCache:
    """One stream's DiT cache between streaming (chunk-masked, non-final) flow calls
    (:meth:`CV3FlowModel.stream_cached_batch`).

    With the static chunk mask counted from frame 0, causal convolutions and fixed noise per frame,
    the Euler trajectory of every frame in a complete static chunk is the same in every later
    streaming call of the stream; so is what later frames read from it. Kept per Euler step, per
    CFG row (conditional, unconditional) and per layer: ``kv`` ``[n_steps, depth, 2 (K, V), 2 (CFG),
    heads, frames, dim_head]`` (rotary applied, model dtype) and ``h0`` ``[n_steps, 2 (CFG), 2 (k -
    1), dim]``: the input projections of the ``2 (k - 1)`` frames before ``frames`` (the causal
    conv position embedding's left field; zeros before frame 0). ``frames``: cached frames (prompt
    included), a multiple of ``static_chunk_size``. Size: :meth:`bytes_per_frame` per frame (1.8 MB
    at full size in bfloat16) plus the fixed ``h0``; freed with the object."""

    frames: int
    kv: Tensor
    h0: Tensor

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + self.h0.numel() * self.h0.element_size()

    @staticmethod
    def bytes_per_frame(cfg: DiTConfig, n_steps: int, dtype: torch.dtype) -> int:
        """``n_steps x depth x 2 (K, V) x 2 (CFG rows) x heads x dim_head x element size``."""
        return n_steps * cfg.depth * 4 * cfg.heads * cfg.dim_head * torch.empty(0, dtype=dtype).element_size()


class DiTCachedPlan:
    """What the Euler steps of one cached streaming solve share (:meth:`DiT.forward_cached`): per
    CFG row (``2B``: conditional rows, then unconditional) the new frames' rotary tables ``cos`` /
    ``sin`` ``[2B, T, dim_head]`` at their absolute positions, the attention mask ``allowed`` ``[2B,
    1, T, F + T]`` (cached keys ``< frames[b]``; new keys chunk-causal and valid), ``valid`` ``[2B,
    T, 1]``, ``keep1`` ``[2B, k - 1 + T, 1]`` (see :meth:`_CausalConvPositionEmbedding.forward_tail`);
    the items' caches (read per step as one right-padded batch) and the new frames' K/V and input
    projections recorded per step. Eager only: ``step`` is a Python counter."""

    def __init__(self, est: "DiT", caches: list, starts: list[int], new_lengths: list[int], n_steps: int,
                 device, dtype):
        cfg = est.cfg
        b = len(starts)
        self.b, self.caches, self.starts, self.n_steps = b, caches, starts, n_steps
        self.depth, self.heads, self.dim_head = cfg.depth, cfg.heads, cfg.dim_head
        self.window = 2 * (cfg.conv_pos_kernel - 1)
        self.dim = cfg.dim
        self.device, self.dtype = device, dtype
        t = max(new_lengths)
        self.fmax = max(starts)
        st = to_device(torch.tensor(starts + starts), device)  # [2B]; pinned copies: no host sync
        n_new = to_device(torch.tensor(new_lengths + new_lengths), device)
        pos = st[:, None] + torch.arange(t, device=device)[None, :]  # absolute positions of the new frames
        cos, sin = est.rotary(max(starts) + t)
        self.cos, self.sin = cos[pos], sin[pos]
        self.sin_signed = signed_sin(self.sin)
        j = torch.arange(t, device=device)
        valid = j[None, :] < n_new[:, None]  # [2B, T]
        self.valid = valid[:, :, None].to(dtype)
        c = cfg.static_chunk_size
        chunk_end = (torch.div(j, c, rounding_mode="floor") + 1) * c  # starts are chunk multiples
        new_ok = valid[:, None, :] & (j[None, :] < chunk_end[:, None])[None]  # [2B, T, T]
        cache_ok = (torch.arange(self.fmax, device=device)[None, :] < st[:, None])[:, None, :].expand(-1, t, -1)
        self.allowed = torch.cat([cache_ok, new_ok], dim=2).unsqueeze(1)
        self.bias = attention_bias(self.allowed, dtype)
        k1 = cfg.conv_pos_kernel - 1
        q = st[:, None] - k1 + torch.arange(k1 + t, device=device)[None, :]
        self.keep1 = (q >= 0)[:, :, None].to(dtype)
        self.step = 0
        self._kv_step = -1
        self._kv = None
        self.rec_h0: list[Tensor] = []
        self.rec_kv: list[list[Tensor]] = []

    def kv(self, step: int, layer: int) -> Tensor | None:
        """Cached ``[2 (K, V), 2B, heads, F, dim_head]`` of ``layer`` at Euler ``step`` (zeros past an
        item's cached frames, masked), or None when no item has cached frames."""
        if self.fmax == 0:
            return None
        if self._kv_step != step:
            b = self.b
            kv = torch.zeros(self.depth, 2, 2 * b, self.heads, self.fmax, self.dim_head, device=self.device,
                             dtype=self.dtype)
            for i, c in enumerate(self.caches):
                if c is not None and c.frames:
                    kv[:, :, i, :, :c.frames] = c.kv[step, :, :, 0]
                    kv[:, :, b + i, :, :c.frames] = c.kv[step, :, :, 1]
            self._kv, self._kv_step = kv, step
        return self._kv[layer]

    def h0_tail(self, step: int) -> Tensor:
        """``[2B, 2 (k - 1), dim]`` input projections of the frames before each item's new frames."""
        b = self.b
        out = torch.zeros(2 * b, self.window, self.dim, device=self.device, dtype=self.dtype)
        for i, c in enumerate(self.caches):
            if c is not None and c.frames:
                out[i], out[b + i] = c.h0[step, 0], c.h0[step, 1]
        return out

    def record(self, h0: Tensor, news: list[Tensor]) -> None:
        self.rec_h0.append(h0)
        self.rec_kv.append(news)
        self.step += 1

    def new_caches(self, keep: list[int]) -> list[DiTStreamCache]:
        """Per item the cache after this solve, extended by its first ``keep[b]`` new frames (those in
        complete static chunks)."""
        b, w = self.b, self.window
        out = []
        kv_all = torch.stack([torch.stack(layers) for layers in self.rec_kv])  # [n, depth, 2, 2B, H, T, dh]
        h0_all = torch.stack(self.rec_h0)  # [n, 2B, T, dim]
        for i, (c, m) in enumerate(zip(self.caches, keep)):
            rows = [i, b + i]
            new_kv = kv_all[:, :, :, rows, :, :m]  # [n, depth, 2, 2, H, m, dh]
            old_h0 = c.h0 if c is not None else torch.zeros(self.n_steps, 2, w, self.dim, device=self.device,
                                                            dtype=self.dtype)
            h0 = torch.cat([old_h0, h0_all[:, rows, :m]], dim=2)[:, :, -w:]
            kv = new_kv if c is None or not c.frames else torch.cat([c.kv, new_kv], dim=5)
            out.append(DiTStreamCache(frames=(c.frames if c is not None else 0) + m, kv=kv.contiguous(),
                                      h0=h0.contiguous()))
        return out


class DiT(nn.Module):
    """CosyVoice3's velocity estimator (upstream ``cosyvoice.flow.DiT.dit.DiT``), see the module
    docstring. Built from :class:`DiTConfig`; parameter names equal upstream's ``state_dict()``
    (``time_embed``, ``input_embed``, ``rotary_embed.inv_freq``, ``transformer_blocks``,
    ``norm_out``, ``proj_out``). Interface of :class:`~cosyserve.models.flow.CausalFlowMatching`'s
    estimator: :meth:`attention_plan` and :meth:`forward_btc`; :meth:`forward` is upstream's call.
    """

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        self.time_embed = _TimestepEmbedding(cfg.dim, cfg.time_freq_dim)
        self.input_embed = _InputEmbedding(cfg)
        self.rotary_embed = _RotaryEmbedding(cfg.dim_head)
        self.transformer_blocks = nn.ModuleList(_DiTBlock(cfg) for _ in range(cfg.depth))
        self.long_skip_connection = nn.Linear(cfg.dim * 2, cfg.dim, bias=False) if cfg.long_skip_connection else None
        self.norm_out = _AdaLayerNorm(cfg.dim, 2)
        self.proj_out = nn.Linear(cfg.dim, cfg.mel_dim)
        self._rotary_cache: tuple[Tensor, Tensor] | None = None
        self._rotary_old: list[tuple[Tensor, Tensor]] = []

    def attention_plan(self, mask: Tensor, streaming: Tensor | bool) -> DiTPlan:
        """Masks and rotary tables from ``mask [B, 1, T]`` (1 valid / 0 padded, model dtype) and
        ``streaming`` (one bool or ``[B]`` bool: static chunk mask of ``static_chunk_size``
        frames). No host synchronisation."""
        b, _, t = mask.shape
        if not isinstance(streaming, Tensor):
            streaming = torch.full((b,), bool(streaming), device=mask.device)
        streaming = streaming.to(device=mask.device, dtype=torch.bool)
        allowed = chunk_attention_mask(mask[:, 0].bool(), streaming, self.cfg.static_chunk_size)
        cos, sin = self.rotary(t)
        allowed = allowed.unsqueeze(1)
        return DiTPlan(allowed=allowed, bias=attention_bias(allowed, mask.dtype), valid=mask.transpose(1, 2),
                       cos=cos, sin=sin, sin_signed=signed_sin(sin))

    def rotary(self, frames: int, start: int = 0) -> tuple[Tensor, Tensor]:
        """Rotary tables ``(cos, sin)`` ``[frames, dim_head]`` float32 of positions ``start ..
        start + frames - 1``, sliced from a table cached on the device of ``inv_freq`` (grown to the
        next power of two when a longer one is asked for; a row's values do not depend on the
        table's length, so slices equal :func:`rotary_tables` of that length bit for bit). While
        a CUDA graph is being captured, a missing table is computed without being cached (a
        captured kernel writes it only at replay). Tables replaced by a longer one stay alive
        (``_rotary_old``; kilobytes to a few MB): a graph captured earlier keeps reading the
        address of the table it was captured with."""
        inv = self.rotary_embed.inv_freq
        need = start + frames
        cached = self._rotary_cache
        if cached is None or cached[0].device != inv.device or cached[0].shape[0] < need:
            size = 1 << max(8, (need - 1).bit_length())
            table = rotary_tables(inv, size)
            capturing = inv.is_cuda and torch.cuda.is_current_stream_capturing()
            if capturing:
                return table[0][start:need], table[1][start:need]
            if cached is not None:
                self._rotary_old.append(cached)
            self._rotary_cache = cached = table
        return cached[0][start:need], cached[1][start:need]

    def forward_btc(self, h: Tensor, plan: DiTPlan, t: Tensor) -> Tensor:
        """Velocity ``[B, T, mel_dim]`` (zero at padded frames) from the packed input
        ``h [B, T, 4 * mel_dim]`` = ``cat(x, mu, spks broadcast over T, cond)`` along channels
        (model dtype), a :class:`DiTPlan` and flow time ``t`` ``[B]`` or ``[1]``. With a
        :class:`DiTCachedPlan` instead, ``h`` holds only the new frames of cached streams
        (:meth:`forward_cached`)."""
        if isinstance(plan, DiTCachedPlan):
            return self.forward_cached(h, plan, t)
        n = self.cfg.mel_dim
        x, mu, spks, cond = h[..., :n], h[..., n:2 * n], h[..., 2 * n:3 * n], h[..., 3 * n:]
        silu_t = self._silu_time(t)
        x = self.input_embed(x, cond, mu, spks)
        residual = x
        for block in self.transformer_blocks:
            x = block(x, silu_t, plan)
        if self.long_skip_connection is not None:
            x = self.long_skip_connection(torch.cat((x, residual), dim=-1))
        scale, shift = self.norm_out(silu_t)
        return self.proj_out(norm_modulate(x, shift, scale)) * plan.valid

    def _silu_time(self, t: Tensor) -> Tensor:
        """``silu(time_embed(t))`` ``[B or 1, 1, dim]`` from ``t`` ``[B]`` or ``[1]``: every block's
        adaLN reads it (one time value for every row -> one row, broadcast)."""
        return F.silu(self.time_embed(t.reshape(-1))).unsqueeze(1)

    def forward_cached(self, h: Tensor, cp: "DiTCachedPlan", t: Tensor) -> Tensor:
        """One Euler step's velocity for the new frames of cached streams: ``h [B, T, 4 * mel_dim]``
        packed as in :meth:`forward_btc` for frames ``cp.start[b] ..`` of each row; reads the cache
        of step ``cp.step`` (K/V of every layer for the frames before, the input projection of the
        ``2 (k - 1)`` frames before for the causal conv position embedding), records the new frames'
        K/V and projections in ``cp`` for the next call's cache, and advances ``cp.step``.
        Eager only (Python state). Equals :meth:`forward_btc` over all frames with the streaming
        chunk mask, restricted to the new frames, up to float summation order."""
        n = self.cfg.mel_dim
        x, mu, spks, cond = h[..., :n], h[..., n:2 * n], h[..., 2 * n:3 * n], h[..., 3 * n:]
        silu_t = self._silu_time(t)
        emb = self.input_embed
        h0 = emb.proj(torch.cat([x, cond, mu, spks], dim=-1))
        step = cp.step
        x = emb.conv_pos_embed.forward_tail(torch.cat([cp.h0_tail(step), h0], dim=1), cp.keep1) + h0
        residual = x
        news = []
        for i, block in enumerate(self.transformer_blocks):
            x, new = block.forward_cached(x, silu_t, cp, cp.kv(step, i))
            news.append(new)
        cp.record(h0, news)
        if self.long_skip_connection is not None:
            x = self.long_skip_connection(torch.cat((x, residual), dim=-1))
        scale, shift = self.norm_out(silu_t)
        return self.proj_out(norm_modulate(x, shift, scale)) * cp.valid

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                streaming: bool | Tensor = False) -> Tensor:
        """Upstream call: ``x, mu, cond [B, mel_dim, T]``, ``mask [B, 1, T]``, ``t [B]``,
        ``spks [B, mel_dim]`` -> velocity ``[B, mel_dim, T]``."""
        frames = x.shape[-1]
        h = torch.cat([x.transpose(1, 2), mu.transpose(1, 2), spks.unsqueeze(1).expand(-1, frames, -1),
                       cond.transpose(1, 2)], dim=-1)
        return self.forward_btc(h, self.attention_plan(mask, streaming), t).transpose(1, 2)


# --------------------------------------------------------------------------------------
# the flow model
# --------------------------------------------------------------------------------------


class CV3FlowModel(FlowModel):
    """CosyVoice3 ``CausalMaskedDiffWithDiT`` for inference (speech tokens -> log-mel).

    Sub-modules (names = ``flow.pt`` key prefixes): ``input_embedding`` ``[vocab_size,
    input_size]``, ``spk_embed_affine_layer`` (``spk_embed_dim -> n_mels``),
    ``pre_lookahead_layer`` (:class:`~cosyserve.models.flow_encoder.PreLookaheadLayer`, hidden
    ``pre_lookahead_channels``), ``decoder`` (:class:`~cosyserve.models.flow.CausalFlowMatching`
    with ``decoder.estimator`` = :class:`DiT`). Everything else — argument checking, padding,
    the solver, :meth:`inference`, :meth:`inference_batch`, :meth:`start` (step-wise issue) — is
    :class:`~cosyserve.models.flow.FlowModel`'s, with the same arguments, results and errors;
    only the conditioning (:meth:`encode`) differs. ``encoder_out`` of a
    :class:`~cosyserve.models.flow.FlowConditioning` is here the upsampled look-ahead output
    ``[B, T, input_size]``.
    """

    def __init__(self, cfg: CV3FlowConfig):
        nn.Module.__init__(self)
        n_mels = cfg.output_size
        self.cfg = cfg
        self.n_mels = n_mels
        self.token_mel_ratio = cfg.token_mel_ratio
        self.pre_lookahead_len = cfg.pre_lookahead_len
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, n_mels)
        self.pre_lookahead_layer = PreLookaheadLayer(cfg.input_size, cfg.pre_lookahead_len,
                                                     hidden=cfg.pre_lookahead_channels)
        # upstream's exact CFG arithmetic: see CausalFlowMatching.exact_cfg
        self.decoder = CausalFlowMatching(cfg.cfm, DiT(cfg.estimator), n_mels, exact_cfg=True)
        self.graph = None

    def _model_dtype(self) -> torch.dtype:
        return self.spk_embed_affine_layer.weight.dtype

    def _model_device(self) -> torch.device:
        return self.spk_embed_affine_layer.weight.device

    def encode(self, ids: Tensor, lengths: Tensor, streaming: Tensor, embeddings: Tensor, feats: Tensor,
               max_encoder_len: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Device part of the conditioning (no host synchronisation); arguments and results as
        :meth:`FlowModel.encode <cosyserve.models.flow.FlowModel.encode>`: ``ids [B, L]``,
        ``lengths [3, B]`` (tokens, look-ahead output positions, mel frames),
        ``max_encoder_len`` >= every item's positions. Returns ``(h [B, T, input_size], mu
        [B, n_mels, T], spks [B, n_mels], cond [B, n_mels, T], mask [B, 1, T])`` with
        ``T = token_mel_ratio * max_encoder_len``."""
        device, dtype = ids.device, self._model_dtype()
        token_len, _, mel_len = lengths.unbind(0)
        t = self.token_mel_ratio * max_encoder_len
        token_mask = torch.arange(ids.size(1), device=device).unsqueeze(0) < token_len.unsqueeze(1)
        x = self.input_embedding(ids.clamp(min=0)) * token_mask.unsqueeze(-1).to(dtype)
        if x.size(1) < max_encoder_len:
            x = F.pad(x, (0, 0, 0, max_encoder_len - x.size(1)))
        # positions past an item's look-ahead output length hold its right-context tokens (non-final
        # chunk) or zeros, which is what the look-ahead convolution reads there
        h = self.pre_lookahead_layer(x)[:, :max_encoder_len]
        h = h.repeat_interleave(self.token_mel_ratio, dim=1)
        mask = (torch.arange(t, device=device).unsqueeze(0) < mel_len.unsqueeze(1)).unsqueeze(1).to(dtype)
        mu = h.transpose(1, 2) * mask
        spks = self.spk_embed_affine_layer(F.normalize(embeddings.to(dtype), dim=1))
        cond = F.pad(feats.to(dtype), (0, 0, 0, t - feats.size(1))).transpose(1, 2)
        return h, mu, spks, cond, mask

    @torch.inference_mode()
    def stream_cached_batch(self, inputs, caches: list) -> tuple[list[Tensor], list[int], list[DiTStreamCache]]:
        """Streaming non-final calls (``streaming=True, finalize=False``; upstream's chunk calls) of
        several streams computing only the frames from each stream's first uncached frame on
        (:class:`DiTStreamCache`: K/V of complete static chunks per Euler step, CFG row and layer),
        eagerly.

        Args: ``inputs`` a :class:`~cosyserve.models.flow.FlowInputs` of :meth:`prepare` (every item
        streaming and non-final); ``caches`` per item its cache from the stream's previous cached
        call, or None (first call: computed from frame 0).

        Returns ``(mels, first, caches)``: per item the float32 mel ``[1, n_mels, n]`` of the
        non-prompt frames ``first[b] ..`` (``inference(...)[:, :, first[b]:]``, within float summation
        order: the frames before ``first[b]`` were produced by earlier calls, identically), and its
        new cache (extended by the new frames of complete static chunks; the caller keeps it per
        stream and drops it at the stream's end or final call, which is a full re-run by upstream's
        semantics). Raises ValueError for final or non-streaming items, a cache of another model,
        dtype or step count, or a cache longer than the call.
        """
        return _cached_stream_batch(self, inputs, caches)


def _cached_stream_batch(flow: "CV3FlowModel", inputs, caches: list) -> tuple[list[Tensor], list[int], list]:
    """See :meth:`CV3FlowModel.stream_cached_batch`."""
    from .flow import SolverState

    b = inputs.ids.shape[0]
    if len(caches) != b:
        raise ValueError(f"flow: {len(caches)} stream caches for {b} items")
    token_len, enc_len = inputs.lengths[0].tolist(), inputs.lengths[1].tolist()
    if not bool(inputs.streaming.all()) or any(e == n for e, n in zip(enc_len, token_len)):
        raise ValueError("flow: the stream cache serves streaming non-final calls only (streaming=True, finalize=False)")
    est = flow.decoder.estimator
    c = est.cfg.static_chunk_size
    n_steps = flow.cfg.cfm.n_timesteps
    device, dtype = flow._model_device(), flow._model_dtype()
    total = list(inputs.mel_lengths)
    starts = []
    for i, (cache, tb) in enumerate(zip(caches, total)):
        f = 0 if cache is None else int(cache.frames)
        if cache is not None and (f % c or f > tb or cache.kv.shape[0] != n_steps or cache.kv.dtype != dtype):
            raise ValueError(f"flow: item {i}'s stream cache ({f} frames) does not fit this call ({tb} frames, "
                             f"chunks of {c}, {n_steps} steps, {dtype})")
        starts.append(f)
    new_len = [tb - f for tb, f in zip(total, starts)]
    if min(new_len) < 1:
        raise ValueError("flow: a cached streaming call must add frames")
    dev = [to_device(x, device) for x in (inputs.ids, inputs.lengths, inputs.streaming, inputs.embeddings, inputs.feats)]
    _, mu, spks, cond, _ = flow.encode(*dev, inputs.max_encoder_len)
    t = max(new_len)
    tmax = mu.shape[-1]
    idx = (to_device(torch.tensor(starts), device)[:, None] + torch.arange(t, device=device)[None, :]).clamp(max=tmax - 1)
    valid = (torch.arange(t, device=device)[None, :] < to_device(torch.tensor(new_len), device)[:, None])[:, :, None]
    take = lambda z: z.transpose(1, 2).gather(1, idx[:, :, None].expand(-1, -1, z.shape[1]))  # noqa: E731
    mu_n = take(mu) * valid.to(dtype)
    cond_n = take(cond)
    noise = flow.decoder.noise(tmax, device, dtype)  # [1, n_mels, Tmax]
    n = flow.n_mels
    x0 = take(noise.expand(b, -1, -1)).contiguous()
    inp = torch.zeros(2 * b, t, 4 * n, device=device, dtype=dtype)
    inp[:b, :, n:2 * n] = mu_n
    inp[:b, :, 2 * n:3 * n] = spks.unsqueeze(1)
    inp[:b, :, 3 * n:] = cond_n
    t_span = flow.decoder.time_span(n_steps, device, dtype)
    plan = DiTCachedPlan(est, caches, starts, new_len, n_steps, device, dtype)
    state = SolverState(xt=x0, t=t_span[0].clone(), dt=t_span[1] - t_span[0],
                        k=torch.zeros((), dtype=torch.long, device=device), t_span=t_span, n=n_steps, inp=inp, plan=plan)
    for _ in range(n_steps):
        flow.decoder.step(state)
    mel = state.mels()  # [B, n_mels, T] float32, frames starts[b] ..
    keep = [tb // c * c - f for tb, f in zip(total, starts)]
    new_caches = plan.new_caches(keep)
    out, first = [], []
    for i, (f, tb, p) in enumerate(zip(starts, total, inputs.prompt_frames)):
        s0 = max(f, p)
        out.append(mel[i:i + 1, :, s0 - f:tb - f])
        first.append(s0 - p)
    return out, first, new_caches


def load_cv3_flow(checkpoint, cfg: CV3FlowConfig, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> CV3FlowModel:
    """Build :class:`CV3FlowModel` from ``cfg``, load ``flow.pt`` strictly
    (:func:`~cosyserve.models.checkpoint.load_strict`), move, set eval mode. Raises
    :class:`~cosyserve.errors.CheckpointError` on unreadable files or key/shape mismatches."""
    from .checkpoint import load_strict, read_state_dict

    model = CV3FlowModel(cfg)
    load_strict(model, read_state_dict(checkpoint), str(checkpoint))
    return model.to(device=device, dtype=dtype).eval()
