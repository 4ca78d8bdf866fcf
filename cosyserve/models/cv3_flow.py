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

__all__ = ["DiTConfig", "CV3FlowConfig", "parse_cv3_flow", "DiT", "DiTPlan", "CV3FlowModel", "load_cv3_flow",
           "rotary_tables"]


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


def _rotate_half_interleaved(x: Tensor) -> Tensor:
    x = x.unflatten(-1, (-1, 2))
    x1, x2 = x.unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x-transformers ``apply_rotary_pos_emb`` on ``x [B, T, D]`` with tables ``[T, d]``
    (``d <= D``): only the first ``d`` channels are rotated; computed in float32, returned in
    ``x.dtype``."""
    d = cos.shape[-1]
    head, rest = x[..., :d], x[..., d:]
    rot = head * cos + _rotate_half_interleaved(head) * sin
    return torch.cat((rot, rest.to(rot.dtype)), dim=-1).to(x.dtype)


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

    def forward(self, t: Tensor) -> tuple[Tensor, ...]:
        return torch.chunk(self.linear(F.silu(t)), self.chunks, dim=1)


def _modulate(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """``LayerNorm(x, eps 1e-6, no affine) * (1 + scale) + shift`` with per-row ``[B, D]`` vectors."""
    return F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale[:, None]) + shift[:, None]


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
        q = apply_rotary(self.to_q(x), plan.cos, plan.sin)
        k = apply_rotary(self.to_k(x), plan.cos, plan.sin)
        v = self.to_v(x)
        q, k, v = (y.view(b, t, self.heads, self.dim_head).transpose(1, 2) for y in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.allowed)
        o = o.transpose(1, 2).reshape(b, t, self.heads * self.dim_head)
        return self.to_out[0](o) * plan.valid


class _FeedForward(nn.Module):
    def __init__(self, dim: int, mult: float):
        super().__init__()
        inner = int(dim * mult)
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")),
                                nn.Dropout(0.0), nn.Linear(inner, dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.ff(x)


class _DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.attn_norm = _AdaLayerNorm(cfg.dim, 6)
        self.attn = _Attention(cfg.dim, cfg.heads, cfg.dim_head)
        self.ff = _FeedForward(cfg.dim, cfg.ff_mult)

    def forward(self, x: Tensor, t: Tensor, plan: "DiTPlan") -> Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(t)
        x = x + gate_msa.unsqueeze(1) * self.attn(_modulate(x, scale_msa, shift_msa), plan)
        return x + gate_mlp.unsqueeze(1) * self.ff(_modulate(x, scale_mlp, shift_mlp))


@dataclass
class DiTPlan:
    """What every Euler step of one solve shares (:meth:`DiT.attention_plan`).

    ``allowed`` ``[B, 1, T, T]`` bool (True = may attend: valid keys, and for streaming rows keys
    in the same or earlier chunks); ``valid`` ``[B, T, 1]`` model dtype (1 valid / 0 padded);
    ``cos`` / ``sin`` ``[T, dim_head]`` float32 rotary tables.
    """

    allowed: Tensor
    valid: Tensor
    cos: Tensor
    sin: Tensor


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
        return DiTPlan(allowed=allowed.unsqueeze(1), valid=mask.transpose(1, 2), cos=cos, sin=sin)

    def rotary(self, frames: int, start: int = 0) -> tuple[Tensor, Tensor]:
        """Rotary tables ``(cos, sin)`` ``[frames, dim_head]`` float32 of positions ``start ..
        start + frames - 1``, sliced from a table cached on the device of ``inv_freq`` (grown to the
        next power of two when a longer one is asked for; a row's values do not depend on the
        table's length, so slices equal :func:`rotary_tables` of that length bit for bit). While
        a CUDA graph is being captured, a missing table is computed without being cached (a
        captured kernel writes it only at replay)."""
        inv = self.rotary_embed.inv_freq
        need = start + frames
        cached = self._rotary_cache
        if cached is None or cached[0].device != inv.device or cached[0].shape[0] < need:
            size = 1 << max(8, (need - 1).bit_length())
            table = rotary_tables(inv, size)
            capturing = inv.is_cuda and torch.cuda.is_current_stream_capturing()
            if capturing:
                return table[0][start:need], table[1][start:need]
            self._rotary_cache = cached = table
        return cached[0][start:need], cached[1][start:need]

    def forward_btc(self, h: Tensor, plan: DiTPlan, t: Tensor) -> Tensor:
        """Velocity ``[B, T, mel_dim]`` (zero at padded frames) from the packed input
        ``h [B, T, 4 * mel_dim]`` = ``cat(x, mu, spks broadcast over T, cond)`` along channels
        (model dtype), a :class:`DiTPlan` and flow time ``t`` ``[B]`` or ``[1]``."""
        n = self.cfg.mel_dim
        b = h.shape[0]
        x, mu, spks, cond = h[..., :n], h[..., n:2 * n], h[..., 2 * n:3 * n], h[..., 3 * n:]
        t_emb = self.time_embed(t.reshape(-1).expand(b) if t.numel() == 1 else t)
        x = self.input_embed(x, cond, mu, spks)
        residual = x
        for block in self.transformer_blocks:
            x = block(x, t_emb, plan)
        if self.long_skip_connection is not None:
            x = self.long_skip_connection(torch.cat((x, residual), dim=-1))
        scale, shift = self.norm_out(t_emb)
        return self.proj_out(_modulate(x, scale, shift)) * plan.valid

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


def load_cv3_flow(checkpoint, cfg: CV3FlowConfig, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> CV3FlowModel:
    """Build :class:`CV3FlowModel` from ``cfg``, load ``flow.pt`` strictly
    (:func:`~cosyserve.models.checkpoint.load_strict`), move, set eval mode. Raises
    :class:`~cosyserve.errors.CheckpointError` on unreadable files or key/shape mismatches."""
    from .checkpoint import load_strict, read_state_dict

    model = CV3FlowModel(cfg)
    load_strict(model, read_state_dict(checkpoint), str(checkpoint))
    return model.to(device=device, dtype=dtype).eval()
