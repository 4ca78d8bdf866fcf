"""Step-Audio2 token2wav flow: speech tokens (25/s) -> 80-bin natural-log mel (50 frames/s) with a DiT.

Algorithm source: PyPI ``token2wav-cosyvoice-stepaudio2==0.1.3`` (the code of GitHub
stepfun-ai/Step-Audio2's token2wav): ``stepaudio2.cosyvoice2.flow.flow.CausalMaskedDiffWithXvec``
(``inference``, ``setup_cache``, ``inference_chunk``), ``flow.flow_matching.CausalConditionalCFM``,
``flow.decoder_dit.DiT`` and ``transformer.upsample_encoder_v2.UpsampleConformerEncoderV2``, and the
driver ``stepaudio2.token2wav.Token2wav`` (``set_stream_cache``/``stream``: three silence tokens,
cache trimming). Independent plain-torch re-implementation; ``DitFlowModel.state_dict()`` has exactly
the keys and shapes of the released token2wav ``flow.pt``.

Pieces
------
* Encoder (v2): the modules of the CosyVoice2 encoder (:mod:`cosyserve.models.flow_encoder`: embed,
  pre-look-ahead layer, ``num_blocks`` relative-position conformer layers, x2 repeat-upsampling,
  ``num_up_blocks`` conformer layers, final LayerNorm) without any chunk mask. Streaming keeps
  per-stream caches: the look-ahead layer's 2 frames, the upsampler's ``2 * stride`` frames and every
  conformer layer's keys/values (oldest first). A non-final chunk's last ``pre_lookahead_len`` tokens
  are look-ahead context only; a final chunk is followed by ``pre_lookahead_len`` zero frames.
* Estimator (``DiT``): ``in_proj`` of ``[x, mu, spk, cond]`` (4 x 80 channels), ``depth`` blocks of
  adaLN-modulated (9 modulation vectors from the timestep embedding) attention with per-head
  LayerNorm on q and k (no positional encoding, full attention over cache + chunk), a causal
  conv block (kernel 3 conv, LayerNorm, Mish, kernel 3 conv) and a tanh-GELU MLP; final adaLN layer.
  Streaming caches per block: keys/values stored **newest first** (``cat([k_new, k_cache])``) and
  the two convolutions' last 2 input frames, separately for each of the ``n_timesteps`` Euler steps
  and for the conditional and unconditional CFG rows.
* CFM: ``n_timesteps`` Euler steps on ``t_k = 1 - cos(k/n * pi/2)`` with upstream's accumulated
  ``t <- t + dt``, ``dt = t_span[k+1] - t``; CFG ``v = (1 + r) v_cond - r v_uncond`` with the
  unconditional rows' ``mu``, speaker and ``cond`` zeroed. Start noise: frames
  ``[offset, offset + T)`` of a fixed buffer ``[1, 80, noise_frames]`` where ``offset`` is the
  estimator cache length (0 offline). Upstream draws that buffer from the *global* torch generator
  when the module is constructed; here it is ``torch.randn(1, 80, noise_frames, generator=g)`` with
  a private CPU ``torch.Generator`` seeded ``DitFlowConfig.noise_seed`` (so seed 4322 reproduces
  ``torch.manual_seed(4322); torch.randn(1, 80, 30000)``); :meth:`DitFlowModel.set_noise` injects
  any other buffer.

Streaming protocol (as ``Token2wav`` drives it)
-----------------------------------------------
:meth:`DitFlowModel.setup` runs the prompt tokens followed by ``silence_tokens`` (three 4218 tokens,
the look-ahead of the prompt's last token) with the prompt mel as ``cond`` and keeps only the caches
(:class:`DitStreamState`, one per stream; nothing is stored on the module). States are immutable,
except that a caller may let a stream's chunks write its estimator caches in place
(:attr:`DitItem.in_place`, :class:`EstimatorStore`: one allocation per stream instead of new caches per
chunk; a replaced state is stale and refused).
:meth:`DitFlowModel.chunk` takes new tokens (a non-final chunk ends with ``pre_lookahead_len``
look-ahead tokens, which the next chunk must send again), returns the chunk's mel
(``2 * (n - lookahead)`` frames, ``2 * n`` on the last chunk) and the next state. After each chunk
the attention caches are trimmed as the driver does: when longer than ``P + keep`` (``P`` prompt
frames, ``keep`` = 100) they become ``cache[:P] ++ cache[-keep:]`` along time. For the DiT cache
(newest first) that keeps the newest ``P`` and the oldest ``keep`` frames; for the conformer cache
(oldest first, the first-stage layers stored twice as ``cat([c, c])`` upstream) the rule is applied to
that doubled layout (see :func:`_trim_index`). Caches are therefore bounded (``P + keep`` frames plus
one chunk) and a chunk's cost does not grow with the stream's length.

Batching: :meth:`DitFlowModel.forward_items` runs any mix of offline items, set-ups and chunks of
different streams (different token counts and cache lengths) in one padded pass. Conformer caches
are left-aligned to a common end so that one relative-position table serves every stream (query
``i`` of stream ``b`` sits at position ``C_max + i``, its cached keys at ``C_max - C_b ..``); padded
keys are masked; convolutions are causal so right padding never reaches valid frames. Results equal
the one-stream results up to float summation order (~1e-7 relative). The per-stream inputs move with
batched operations (index lists built on the host and copied once; one copy per stream for the
estimator caches); each new state is copied out into storages of its own (a few copies per stream and
cache kind), so a batch's host work grows little with its stream count.

CUDA graphs (:class:`GraphedDiTSolve`): the Euler/CFG solve per (rows, frames, cache) bucket, and
the encoder in a padded static-shape form (:meth:`DitFlowModel._encode_static`: per-row token counts,
final flags, cache lengths and padding rows as tensors in static buffers, the conformer keys/values
written in place after left-aligned caches) for the bucket the solve's implies; it equals the eager
encoder up to float summation order.

Numerics: float32 by default; the module may be cast to bfloat16/float16, then every computation
including the time grid runs in that dtype (upstream runs under autocast); mel is returned as float32.
"""

from __future__ import annotations

import array
import functools
import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from .config import DiTConfig, DitFlowConfig
from .conv_cols import causal_cols
from .flow_encoder import UpsampleConformerEncoder, relative_position_table
from .derived import DerivedWeights
from .fused import FusedOp, add_norm_modulate, attention_bias, linear_gelu_tanh, norm_modulate
from .graphs import _GraphStage
from .views import cat_adjacent as _cat
from .views import cat_wide, copy_wide_
from .views import merge_adjacent as _merge_adjacent

log = logging.getLogger(__name__)

__all__ = ["DiT", "DitFlowModel", "DitStreamState", "DitItem", "DitItemResult", "GraphedDiTSolve", "trim_state",
           "stream_solve_shapes", "EstimatorStore", "CacheWriteBack",
           "SILENCE_TOKEN", "TRIM_KEEP"]

#: the silence token Step-Audio2's ``Token2wav.set_stream_cache`` appends (three times) to the prompt
SILENCE_TOKEN = 4218
#: frames kept past the prompt when the driver trims the attention caches (``[:P] ++ [-100:]``)
TRIM_KEEP = 100


def _ints(values, dev) -> Tensor:
    """1-D int64 tensor of Python ints on ``dev``, without a host-device sync on CUDA (pinned staging
    buffer + non-blocking copy; a plain ``torch.tensor(..., device=cuda)`` waits for the stream).
    The ints go through an ``array('q')`` (about 8x faster than ``torch.tensor`` of a list: index
    lists of a batch hold every cached frame of every stream)."""
    buf = array.array("q", values)
    t = torch.frombuffer(buf, dtype=torch.long) if len(buf) else torch.zeros(0, dtype=torch.long)
    dev = torch.device(dev)
    if dev.type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True)
    return t.to(dev)


def _to_device(t: Tensor, dev) -> Tensor:
    """``t.to(dev)`` without a host-device sync when ``t`` is a CPU tensor going to CUDA."""
    dev = torch.device(dev)
    if dev.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(dev, non_blocking=True)
    return t.to(dev)


# ----------------------------------------------------------------------------------------------
# DiT estimator
# ----------------------------------------------------------------------------------------------


def _qk_norm_kv(qkv: Tensor, qw: Tensor, qb: Tensor, kw: Tensor, kb: Tensor, q_eps: float,
                k_eps: float) -> tuple[Tensor, Tensor]:
    """From one q/k/v GEMM's output ``qkv [N, T, 3, H, hd]``: ``q`` LayerNorm-ed over ``hd``
    ``[N, T, H, hd]`` and the new keys ‖ values ``[N, T, H, 2*hd]`` (k LayerNorm-ed)."""
    hd = qkv.shape[-1]
    q = F.layer_norm(qkv[:, :, 0], (hd,), qw, qb, q_eps)
    k = F.layer_norm(qkv[:, :, 1], (hd,), kw, kb, k_eps)
    return q, torch.cat([k, qkv[:, :, 2]], dim=-1)


#: one compiled kernel on CUDA for both norms and the k ‖ v layout (was two LayerNorms and two copies)
_QK_NORM_KV = FusedOp(_qk_norm_kv, "dit_qk_norm_kv")


def _estimator_input(x: Tensor, static_in: Tensor) -> Tensor:
    """The estimator's input ``[2B, 80 + C, M]`` in ``static_in``'s dtype: the ODE state ``x [B, 80, M]``
    (float32) for both CFG rows of each item, then ``static_in [2B, C, M]`` (``mu ‖ spk ‖ cond``)."""
    return torch.cat([x.to(static_in.dtype).repeat_interleave(2, dim=0), static_in], dim=1)


def _cfg_euler_step(x: Tensor, v: Tensor, dt: Tensor, static_in: Tensor, r: float) -> tuple[Tensor, Tensor]:
    """One Euler step with classifier-free guidance (upstream ``CausalConditionalCFM.solve_euler``):
    ``v [2B, 80, M]`` (rows conditional, unconditional per item) -> ``x + dt * ((1 + r) v_cond - r v_uncond)``
    (float32) and the next step's :func:`_estimator_input`."""
    b, n, m = x.shape
    v = v.float().view(b, 2, n, m)
    x = x + dt * ((1.0 + r) * v[:, 0] - r * v[:, 1])
    return x, _estimator_input(x, static_in)


#: on CUDA one compiled kernel (or two) for the CFG combination, the Euler update and the next input (~8)
_CFG_EULER = FusedOp(_cfg_euler_step, "dit_cfg_euler")


class _DiTAttention(nn.Module):
    """Multi-head attention with per-head LayerNorm on q and k (``decoder_dit.Attention``, qk_norm)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        inner = num_heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.q_norm = nn.LayerNorm(head_dim)
        self.k_norm = nn.LayerNorm(head_dim)
        self.proj = nn.Linear(inner, dim)
        self._derived = DerivedWeights()

    def qkv_weights(self) -> tuple[Tensor, Tensor]:
        """``(weight [3 * inner, dim], bias [3 * inner])``: ``to_q``, ``to_k``, ``to_v`` stacked (one GEMM)."""
        lin = (self.to_q, self.to_k, self.to_v)
        ws, bs = tuple(m.weight for m in lin), tuple(m.bias for m in lin)
        return (self._derived.get("w", ws, lambda: torch.cat([w.detach() for w in ws])),
                self._derived.get("b", bs, lambda: torch.cat([b.detach() for b in bs])))

    def forward(self, x: Tensor, kv: Tensor, mask: Tensor | None) -> Tensor:
        """``x [N, T, dim]``; ``kv [N, H, T + C, 2*head_dim]`` (k ‖ v, newest first) whose last ``C``
        frames hold the cache; ``mask [N, 1, T or 1, T + C]`` bool (True = attend) or the same as an
        additive bias in ``x``'s dtype (:func:`~cosyserve.models.fused.attention_bias`), or None ->
        ``[N, T, dim]``.

        The new keys/values are written **in place** into ``kv[:, :, :T]`` (so ``kv`` afterwards is
        upstream's new cache ``cat([new, cache])``, with no copy of the cache). q/k/v are one GEMM
        over the stacked weights, the q/k LayerNorms and the k ‖ v layout one fused op."""
        b, t, _ = x.shape
        hd = self.head_dim
        w, bias = self.qkv_weights()
        qkv = F.linear(x, w, bias).view(b, t, 3, self.num_heads, hd)
        qn, kn = self.q_norm, self.k_norm
        q, new = _QK_NORM_KV(qkv, qn.weight, qn.bias, kn.weight, kn.bias, qn.eps, kn.eps)
        kv[:, :, :t].copy_(new.transpose(1, 2))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), kv[..., :hd], kv[..., hd:], attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(b, t, -1))


class _CausalConv(nn.Conv1d):
    """Conv1d applied to ``cat([cache, x])`` (cache: the previous ``kernel - 1`` input frames)."""

    def step_tc(self, x: Tensor, cache: Tensor, last_idx: Tensor | None,
                new_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Time-major :meth:`step` as one GEMM over the unfolded input (no layout changes, no cuDNN
        transposes): ``x [N, T, C_in]``, ``cache [N, C_in, k-1]`` -> ``([N, T, C_out], new cache
        [N, C_in, k-1])``; ``last_idx [N, k-1]``: per row, the frames of ``cache ++ x`` that become
        the new cache (the last ``k-1`` valid ones), None: the last ``k-1``; ``new_out``: where the new
        cache is written. The GEMM's input and the new cache come from
        :func:`~cosyserve.models.conv_cols.causal_cols` (one Triton kernel on CUDA, also inside the
        solve's CUDA graphs; docs/perf.md "Session 33")."""
        cols, new = causal_cols(x, cache, last_idx, new_out)
        return F.linear(cols, self.weight.reshape(self.out_channels, -1), self.bias), new


def _conv_tc(conv: nn.Conv1d, x: Tensor) -> Tensor:
    """``conv`` (stride 1, no padding or dilation, one group) over time-major ``x [N, T, C_in]`` ->
    ``[N, T - k + 1, C_out]`` as one GEMM over the unfolded input (as :meth:`_CausalConv.step_tc`).
    The streaming encoder's convolutions run this way, eagerly and in its CUDA graph: a float32 GEMM
    whose products do not depend on the batch's padded shape (cuDNN's convolution picks algorithms,
    TF32 by default, per shape), so padded and unpadded batches agree to float round-off."""
    k = conv.kernel_size[0]
    n, t, _ = x.shape
    cols = x.unfold(1, k, 1).reshape(n, t - k + 1, -1)  # [N, T-k+1, C_in*k], channel-major like the weight
    return F.linear(cols, conv.weight.reshape(conv.out_channels, -1), conv.bias)


def _right_padded(rows: Sequence[list[int] | None], width: int) -> list[int]:
    """Host token lists right-padded with 0 to ``width`` each, concatenated (a row that is None —
    tokens on the device, copied in afterwards — is all zeros): the flat ``[len(rows) * width]`` list
    one host-to-device copy moves."""
    flat: list[int] = []
    for v in rows:
        if v is None:
            flat += [0] * width
        else:
            flat += v
            flat += [0] * (width - len(v))
    return flat


def _last_frames_tc(xx: Tensor, n: int, new_len: Tensor | None) -> Tensor:
    """From time-major ``xx [N, n + T, C]`` (n cached frames + T new, padded) the last ``n`` valid
    frames per row (``new_len [N]`` new frames per row; None: all ``T``), channel-major ``[N, C, n]``."""
    if n == 0:
        return xx[:, :0].transpose(1, 2)
    if new_len is None:
        return xx[:, -n:].transpose(1, 2)
    idx = new_len.view(-1, 1) + torch.arange(n, device=xx.device).view(1, -1)  # [N, n]
    return torch.gather(xx, 1, idx.unsqueeze(-1).expand(-1, -1, xx.size(2))).transpose(1, 2)


class _CausalConvBlock(nn.Module):
    """``decoder_dit.CausalConvBlock``: causal conv, LayerNorm, Mish, causal conv (``[N, T, C]``)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        # keys block.1 / block.3 / block.6 as upstream's Sequential (the others hold no weights)
        self.block = nn.ModuleDict({
            "1": _CausalConv(channels, channels, kernel),
            "3": nn.LayerNorm(channels),
            "6": _CausalConv(channels, channels, kernel),
        })
        self.channels = channels

    def forward(self, x: Tensor, cache: Tensor, last_idx: Tensor | None,
                out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``x [N, T, C]``, ``cache [N, 2C, k-1]`` -> ``([N, T, C], new cache [N, 2C, k-1])``;
        ``last_idx`` as :meth:`_CausalConv.step_tc` (None: every row has ``T`` valid frames); the new
        cache is written into ``out`` (contiguous, that shape) when given."""
        c1, c2 = cache.split(self.channels, dim=1)
        if out is None:
            out = torch.empty(cache.shape, dtype=x.dtype, device=x.device)
        c = self.channels  # each convolution writes its new cache into its half
        n1, n2 = out.narrow(1, 0, c), out.narrow(1, c, c)
        h, _ = self.block["1"].step_tc(x, c1, last_idx, n1)
        ln = self.block["3"]
        h = _NORM_MISH(h, ln.weight, ln.bias) if ln.eps == 1e-5 else F.mish(ln(h))
        h, _ = self.block["6"].step_tc(h, c2, last_idx, n2)
        return h, out


def _norm_mish(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``mish(layer_norm(x, weight, bias, eps=1e-5))`` over the last dim (the conv block's middle)."""
    return F.mish(F.layer_norm(x, (x.shape[-1],), weight, bias, eps=1e-5))


#: one kernel on CUDA (Inductor, :class:`~cosyserve.models.fused.FusedOp`); eager elsewhere
_NORM_MISH = FusedOp(_norm_mish, "dit_norm_mish")


class _DiTBlock(nn.Module):
    """adaLN-Zero DiT block with a causal conv branch (``decoder_dit.DiTBlock``)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        h = cfg.hidden_size
        self.attn = _DiTAttention(h, cfg.num_heads, cfg.head_dim)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(h, cfg.mlp_hidden)
        self.mlp.fc2 = nn.Linear(cfg.mlp_hidden, h)
        self.conv = _CausalConvBlock(h, cfg.conv_kernel_size)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(h, 9 * h))
        self.hidden = h

    def forward(self, x: Tensor, mod: Tensor, kv: Tensor, cnn_cache: Tensor, mask: Tensor | None,
                last_idx: Tensor | None, res: tuple[Tensor, Tensor] | None = None, cnn_out: Tensor | None = None
                ) -> tuple[Tensor, tuple[Tensor, Tensor], Tensor]:
        """``x [N, T, hidden]``, ``mod`` = ``adaLN_modulation(c)`` ``[N or 1, 1, 9*hidden]`` (the time
        conditioning), ``kv`` as :meth:`_DiTAttention.forward` (updated in place), ``last_idx`` as
        :meth:`_CausalConv.step_tc`; ``res`` ``(gate, y)``: the previous block's last residual branch,
        not yet added to ``x`` -> ``(x, this block's last branch (gate_mlp, mlp output), new cnn cache)``:
        upstream's block output is ``x + gate_mlp * mlp``. Each residual join runs fused with the
        adaLN norm that reads it (:data:`~cosyserve.models.fused.add_norm_modulate`). ``cnn_out``:
        where to write the new cnn cache (see :meth:`_CausalConvBlock.forward`)."""
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
         shift_conv, scale_conv, gate_conv) = mod.chunk(9, dim=-1)
        if res is None:
            h = norm_modulate(x, shift_msa, scale_msa)
        else:
            x, h = add_norm_modulate(x, res[0], res[1], shift_msa, scale_msa)
        x, h = add_norm_modulate(x, gate_msa, self.attn(h, kv, mask), shift_conv, scale_conv)
        cv, new_cnn = self.conv(h, cnn_cache, last_idx, cnn_out)
        x, h = add_norm_modulate(x, gate_conv, cv, shift_mlp, scale_mlp)
        fc1 = self.mlp.fc1
        return x, (gate_mlp, self.mlp.fc2(linear_gelu_tanh(h, fc1.weight, fc1.bias))), new_cnn


class _FinalLayer(nn.Module):
    def __init__(self, hidden: int, out_channels: int):
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.linear = nn.Linear(hidden, out_channels)
        self.hidden = hidden

    def forward(self, x: Tensor, mod: Tensor, res: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``x [N, T, hidden]``, ``mod`` = ``adaLN_modulation(c)`` ``[N or 1, 1, 2*hidden]``, ``res`` the
        last block's pending residual branch (see :meth:`_DiTBlock.forward`)."""
        shift, scale = mod.chunk(2, dim=-1)
        if res is None:
            return self.linear(norm_modulate(x, shift, scale))
        return self.linear(add_norm_modulate(x, res[0], res[1], shift, scale)[1])


class _TimestepEmbedder(nn.Module):
    """Sinusoidal embedding of ``1000 t`` (``frequency_embedding_size`` channels, cos then sin), MLP."""

    def __init__(self, hidden: int, freq: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(freq, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.freq = freq

    def forward(self, t: Tensor) -> Tensor:
        """``t [N]`` -> ``[N, hidden]``."""
        half = self.freq // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half).to(t)
        args = (t * 1000)[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if self.freq % 2:
            emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
        return self.mlp(emb)


class DiT(nn.Module):
    """The DiT velocity estimator, streaming form (``DiT.forward_chunk``; offline = no cache).

    Built from :class:`~cosyserve.models.config.DiTConfig`; keys equal upstream's
    (``t_embedder``, ``in_proj``, ``blocks.i.{attn,mlp,conv,adaLN_modulation}``, ``final_layer``).
    """

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        self.t_embedder = _TimestepEmbedder(cfg.hidden_size, cfg.frequency_embedding_size)
        self.in_proj = nn.Linear(cfg.in_channels, cfg.hidden_size)
        self.blocks = nn.ModuleList(_DiTBlock(cfg) for _ in range(cfg.depth))
        self.final_layer = _FinalLayer(cfg.hidden_size, cfg.out_channels)

    def modulations(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """The time conditioning of every block for each time value: ``t [S]`` (module dtype) ->
        ``(blocks [S, depth, 1, 1, 9*hidden], final [S, 1, 1, 2*hidden])``. It depends on ``t`` only
        (not on the rows), so a solve computes it once per Euler step for every row and stream."""
        c = self.t_embedder(t).unsqueeze(1)  # [S, 1, hidden]
        blocks = torch.stack([blk.adaLN_modulation(c) for blk in self.blocks], dim=1)  # [S, depth, 1, 9h]
        return blocks.unsqueeze(2), self.final_layer.adaLN_modulation(c).unsqueeze(1)

    def conv_last_idx(self, new_len: Tensor | None) -> Tensor | None:
        """``[N, k-1]``: per row the frames of ``cache ++ x`` that become the conv caches (the last
        ``k-1`` valid ones, for ``new_len [N]`` valid new frames); None when ``new_len`` is None or the
        kernel is 1. Shared by every block and evaluation of a solve."""
        if new_len is None or self.cfg.conv_kernel_size <= 1:
            return None
        return new_len.view(-1, 1) + torch.arange(self.cfg.conv_kernel_size - 1, device=new_len.device).view(1, -1)

    def forward(self, x: Tensor, t: Tensor | None, kv: Tensor, cnn_cache: Tensor, mask: Tensor | None,
                new_len: Tensor | None, mods: tuple[Tensor, Tensor] | None = None,
                last_idx: Tensor | None = None, cnn_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One velocity evaluation.

        Args:
            x: ``[N, in_channels, T]`` stacked ``[x, mu, spk, cond]`` (right-padded rows).
            t: ``[N]`` time in [0, 1] (ignored when ``mods`` is given).
            kv: ``[depth, N, H, T + C, 2*head_dim]`` keys ‖ values: the last ``C`` frames hold the cache
                (newest first; ``C`` may be 0); the first ``T`` are overwritten **in place** with this
                call's keys/values, so afterwards ``kv`` is the new cache (per row ``cat([new, cache])``
                in padded layout).
            cnn_cache: ``[depth, N, 2*hidden, kernel-1]`` (zeros at the start of a stream).
            mask: ``[N, 1, T or 1, T + C]`` bool, or the same as an additive bias
                (:func:`~cosyserve.models.fused.attention_bias`, what solves pass), or None (no padding).
            new_len: ``[N]`` valid frames per row or None (all ``T``).
            mods: this step's ``(blocks [depth, 1, 1, 9*hidden], final [1, 1, 2*hidden])`` from
                :meth:`modulations`, or None (computed from ``t`` per row).
            last_idx: :meth:`conv_last_idx` of ``new_len`` when the caller has it (a solve computes it
                once), else computed here.
            cnn_out: ``[depth, N, 2*hidden, k-1]`` contiguous: where the new cnn cache is written
                (returned), else a new tensor.

        Returns ``(velocity [N, out_channels, T], new cnn cache [depth, N, 2*hidden, k-1])``.
        """
        if mods is None:
            c = self.t_embedder(t).unsqueeze(1)
            mods = ([blk.adaLN_modulation(c) for blk in self.blocks], self.final_layer.adaLN_modulation(c))
        h = self.in_proj(x.transpose(1, 2))
        if last_idx is None:
            last_idx = self.conv_last_idx(new_len)  # the conv caches' frames, shared by every block
        caches = []
        res = None  # each block's last residual branch is added fused with the next norm
        for i, blk in enumerate(self.blocks):
            h, res, nc = blk(h, mods[0][i], kv[i], cnn_cache[i], mask, last_idx, res,
                             None if cnn_out is None else cnn_out[i])
            caches.append(nc)
        v = self.final_layer(h, mods[1], res).transpose(1, 2)
        return v, (torch.stack(caches) if cnn_out is None else cnn_out)


# ----------------------------------------------------------------------------------------------
# streaming state
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DitStreamState:
    """Per-stream caches of :class:`DitFlowModel` (every step returns a new one; immutable unless the
    step was :attr:`DitItem.in_place`, see ``est_store``).

    Shapes (``H``/``dk`` encoder heads/head size, ``h``/``hd`` DiT heads/head size, ``S`` Euler steps):

    * ``spk``: ``[1, 80]`` projected speaker embedding.
    * ``enc_att1``: ``[num_blocks, 1, H, C1, 2*dk]`` first-stage conformer keys ‖ values (token rate,
      oldest first); ``enc_att2``: ``[num_up_blocks, 1, H, 2*C1, 2*dk]`` (mel rate).
    * ``enc_lookahead``: ``[1, D, 2]`` look-ahead layer cache; ``enc_up``: ``[1, D, 2*stride]``.
    * ``est_att``: ``[S, depth, 2, h, C, 2*hd]`` DiT keys ‖ values per step, rows (cond, uncond),
      newest first; ``est_cnn``: ``[S, depth, 2, 2*hidden, 2]``.
    * ``prompt_frames``: ``P``, mel frames of the prompt (the trimming rule keeps them).

    ``noise_offset`` (= ``C``) is where the next chunk's start noise begins.

    States made by :meth:`DitFlowModel.forward_items` hold tensors of their own (contiguous, one
    storage per state tensor: never views of a batch tensor, whose storage would live as long as
    any state of the batch); nothing writes them afterwards, so states stay immutable and may be
    shared (the engine's set-up cache does). The exception: a state made by an in-place item has
    ``est_att`` as a view of frames ``[0, C)`` of the stream's ``est_store`` (its own storage too),
    which the stream's next in-place chunk overwrites; from then on this state is :attr:`stale`.
    """

    spk: Tensor
    prompt_frames: int
    enc_att1: Tensor
    enc_att2: Tensor
    enc_lookahead: Tensor
    enc_up: Tensor
    est_att: Tensor
    est_cnn: Tensor
    #: in-place streams (:attr:`DitItem.in_place`): the store ``est_att`` is a view of, and the store
    #: generation this state's caches belong to (stale once a later chunk wrote the store)
    est_store: EstimatorStore | None = None
    est_generation: int = 0

    @property
    def noise_offset(self) -> int:
        return int(self.est_att.shape[4])

    @property
    def cache_frames(self) -> int:
        return int(self.est_att.shape[4])

    @property
    def stale(self) -> bool:
        """True once a later chunk of the stream wrote this state's estimator store in place."""
        return self.est_store is not None and self.est_store.generation != self.est_generation

    def nbytes(self) -> int:
        """Device bytes the state holds (an in-place stream's whole estimator store, not the view);
        computed once (the engine's memory bound sums it over the active streams)."""
        return self._nbytes

    @functools.cached_property
    def _nbytes(self) -> int:
        est = self.est_att if self.est_store is None else self.est_store.tensor
        return sum(t.numel() * t.element_size() for t in (
            self.spk, self.enc_att1, self.enc_att2, self.enc_lookahead, self.enc_up, est, self.est_cnn))


class EstimatorStore:
    """One stream's DiT key/value caches, written in place chunk after chunk (:attr:`DitItem.in_place`).

    ``tensor`` ``[S, depth, 2, h, capacity, 2*hd]`` (the layout of :attr:`DitStreamState.est_att`, whose
    frames ``[0, C)`` are the state's cache, newest first); ``capacity`` is ``P + trim_keep`` frames, the
    most a trimmed cache holds, so a stream allocates its store once, at its first chunk, and every
    later chunk overwrites it instead of allocating new caches while the old ones are alive (what
    made a batch hold two copies of its streams' caches, and fragmented the allocator with caches of
    growing sizes). ``generation`` counts the writes: a state whose
    :attr:`DitStreamState.est_generation` differs is stale and rejected.
    """

    __slots__ = ("tensor", "generation")

    def __init__(self, tensor: Tensor):
        self.tensor = tensor
        self.generation = 0

    @property
    def capacity(self) -> int:
        return int(self.tensor.shape[4])


class CacheWriteBack:
    """The copies of a batch's new estimator caches into their streams' stores, deferred to
    :meth:`commit` (see :meth:`DitFlowModel.forward_items`, ``write_back``).

    Until the commit, the stores hold the old caches, so the states the batch was given stay valid
    and the batch can be re-run (the engine re-runs each job of a failed batch alone); the new
    states are valid only after it. The copies read the solve's key/value buffer, which the next
    solve of the same model rewrites: the model refuses another batch while a write-back is pending.
    """

    def __init__(self):
        self._copies: list[tuple[Tensor, Tensor]] = []
        self._generations: list[tuple[EstimatorStore, int]] = []
        self.pending = False

    def _add(self, store: EstimatorStore, generation: int, copies: list[tuple[Tensor, Tensor]]) -> None:
        self._copies += copies
        self._generations.append((store, generation))
        self.pending = True

    def commit(self) -> None:
        """Write the new caches (device copies, enqueued on the current stream) and make the new
        states current (their predecessors stale). If a copy raises, the stores it was writing hold
        neither whole: their old and new states are all stale (refused with a clear error)."""
        try:
            with torch.inference_mode():  # the stores are inference tensors
                for dst, src in self._copies:
                    copy_wide_(dst, src)
        except BaseException:
            for store, _ in self._generations:
                store.generation = -1
            raise
        else:
            for store, gen in self._generations:
                store.generation = gen
        finally:
            self.discard()

    def discard(self) -> None:
        """Drop the copies: the stores keep the old caches, the batch's new states are stale."""
        self._copies, self._generations, self.pending = [], [], False


def _trim_index(length: int, prompt: int, keep: int, device) -> Tensor | None:
    """Indices of upstream's trim ``[:prompt] ++ [-keep:]`` on a time axis of ``length``; None if no trim."""
    if length <= prompt + keep:
        return None
    return torch.cat([torch.arange(prompt, device=device), torch.arange(length - keep, length, device=device)])


def _own(t: Tensor) -> Tensor:
    """A contiguous copy of ``t`` in a storage of its own (for stream states: see DitStreamState)."""
    return t.clone(memory_format=torch.contiguous_format)


def _cache_runs(m: int, mmax: int, c: int, prompt: int, keep: int | None) -> list[tuple[int, int]]:
    """Where an item's new estimator cache lies in a solve's key/value buffer, as ``[start, stop)``
    runs along its frame axis, oldest last: the item's ``m`` new frames at ``[0, m)``, its ``c``
    cached frames at ``[mmax, mmax + c)`` (newest first), trimmed like :func:`trim_state` to the
    first ``prompt`` ++ the last ``keep`` of those ``m + c`` frames when ``keep`` is given."""
    runs = [(0, m), (mmax, mmax + c)]
    if keep is None or m + c <= prompt + keep:
        return _merged([r for r in runs if r[1] > r[0]])

    def take(lo: int, hi: int) -> list[tuple[int, int]]:  # frames lo..hi-1 of the concatenated runs
        out, at = [], 0
        for a, e in runs:
            s0, s1 = max(lo, at), min(hi, at + e - a)
            if s1 > s0:
                out.append((a + s0 - at, a + s1 - at))
            at += e - a
        return out

    return _merged(take(0, prompt) + take(m + c - keep, m + c))


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[start, stop)`` runs with each run that starts where the previous one stops joined to it."""
    out: list[tuple[int, int]] = []
    for a, e in runs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], e)
        else:
            out.append((a, e))
    return out


def trim_state(state: DitStreamState, keep: int = TRIM_KEEP) -> DitStreamState:
    """Bound the attention caches as Step-Audio2's ``Token2wav.stream`` does after each chunk.

    When a cache is longer than ``P + keep`` frames it becomes ``[:P] ++ [-keep:]`` along time: the DiT
    cache directly; the conformer cache on upstream's layout ``cat([c1, c1])`` (first stage, doubled) /
    ``c2`` (second stage), whose first half is then the new first-stage cache (so ``c1`` keeps the
    entries ``idx[:(P + keep)/2] mod C1``). Returns ``state`` itself when nothing is trimmed.
    """
    p = state.prompt_frames
    est_att, enc_att1, enc_att2 = state.est_att, state.enc_att1, state.enc_att2
    idx = _trim_index(est_att.shape[4], p, keep, est_att.device)
    if idx is not None:
        est_att = est_att.index_select(4, idx)
    length = enc_att2.shape[3]
    idx = _trim_index(length, p, keep, enc_att2.device)
    if idx is not None:
        c1 = enc_att1.shape[3]
        enc_att2 = enc_att2.index_select(3, idx)
        enc_att1 = enc_att1.index_select(3, idx[: (p + keep) // 2] % c1)
    if est_att is state.est_att and enc_att2 is state.enc_att2:
        return state
    return DitStreamState(state.spk, p, enc_att1, enc_att2, state.enc_lookahead, state.enc_up, est_att, state.est_cnn)


# ----------------------------------------------------------------------------------------------
# the flow model
# ----------------------------------------------------------------------------------------------


@dataclass
class DitItem:
    """One row of :meth:`DitFlowModel.forward_items`.

    ``tokens`` ``[L]`` int speech tokens; ``spk`` ``[1, 80]`` *projected* speaker embedding;
    ``last``: no look-ahead context at the end (pad with zeros); ``state``: caches or None (start);
    ``cond`` ``[F, 80]`` mel for the first F frames of the conditional rows (prompt) or None;
    ``prompt_frames``: stored in the new state (P).
    ``in_place``: the new estimator caches go into the stream's :class:`EstimatorStore` (allocated at
    ``P + trim_keep`` frames when ``state`` has none, e.g. a set-up state, which is never written),
    overwriting ``state``'s caches: ``state`` must be the stream's newest state and is stale
    afterwards. Off: the new caches are copied into a storage of their own (states stay immutable).
    """

    tokens: Tensor
    spk: Tensor
    last: bool
    state: DitStreamState | None = None
    cond: Tensor | None = None
    prompt_frames: int = 0
    in_place: bool = False


@dataclass
class DitItemResult:
    """``mel`` ``[1, 80, M]`` float32 (all frames of the item, prompt frames included) and the new state
    (None for a final item when :meth:`DitFlowModel.forward_items` was asked not to keep it)."""

    mel: Tensor
    state: DitStreamState | None


class DitFlowModel(nn.Module):
    """Step-Audio2 ``CausalMaskedDiffWithXvec`` (see the module docstring for the algorithm).

    Built from :class:`~cosyserve.models.config.DitFlowConfig`. Public entry points: :meth:`inference`
    (offline), :meth:`setup` / :meth:`chunk` (streaming, one stream), :meth:`setup_batch` /
    :meth:`chunk_batch` / :meth:`forward_items` (several streams in one pass). Raises ValueError on
    bad shapes, out-of-range tokens, chunks too short to produce a frame, or streams longer than the
    noise buffer.
    """

    def __init__(self, cfg: DitFlowConfig):
        super().__init__()
        if cfg.encoder.upsample_stride != 2:
            # upstream packs the token-rate caches as repeat(..., 2, ...) next to the mel-rate ones
            raise ConfigError(f"DiT flow: up_stride {cfg.encoder.upsample_stride} unsupported (the cache layout needs 2)")
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = UpsampleConformerEncoder(cfg.encoder)
        self.encoder_proj = nn.Linear(cfg.encoder.output_size, cfg.output_size)
        self.decoder = nn.Module()
        self.decoder.estimator = DiT(cfg.estimator)
        gen = torch.Generator(device="cpu").manual_seed(cfg.noise_seed)
        noise = torch.randn(1, cfg.output_size, cfg.noise_frames, generator=gen, device="cpu")
        try:
            target = torch.empty(0).device
            if target.type != "meta":
                noise = noise.to(target)
        except RuntimeError:  # pragma: no cover
            pass
        self.register_buffer("rand_noise", noise, persistent=False)
        #: optional :class:`GraphedDiTSolve` (CUDA graphs of the whole solve), see :meth:`enable_cuda_graphs`
        self.graph = None
        self._tc_cache = None  # (key, time grid + estimator time conditioning), see _time_conditioning
        self._noise_pad = None  # (rand_noise, its frames followed by a zero frame), see _padded_noise
        self._write_back: CacheWriteBack | None = None  # the last batch's (forward_items refuses while pending)

    # ------------------------------------------------------------------ basics

    @property
    def n_mels(self) -> int:
        return self.cfg.output_size

    @property
    def pre_lookahead_len(self) -> int:
        return self.cfg.encoder.pre_lookahead_len

    @property
    def up_rate(self) -> int:
        return self.cfg.encoder.upsample_stride

    def _apply(self, fn, recurse=True):
        # .to(device, dtype) moves the noise buffer but keeps it float32 (the ODE state is float32)
        noise = self.rand_noise
        super()._apply(fn, recurse)
        if noise.device.type != "meta" and self.rand_noise.device.type != "meta":
            self.rand_noise = noise.to(self.rand_noise.device)
        return self

    def enable_cuda_graphs(self, frames_bucket: int = 25, cache_bucket: int = 64, max_graphs: int = 512,
                           encoder: bool = True) -> "GraphedDiTSolve":
        """Replay the whole CUDA solve from a CUDA graph per (rows, padded frames, padded cache)
        bucket (see :class:`GraphedDiTSolve`: captured by its ``warmup()`` for the buckets it was
        planned for, or on first use while ``capture_on_use``), and with ``encoder`` the batch's
        streaming encoder too (a second graph per bucket, :meth:`_encode_static`). Returns it."""
        self.graph = GraphedDiTSolve(frames_bucket, cache_bucket, max_graphs, flow=self, encoder=encoder)
        return self.graph

    def set_noise(self, noise: Tensor) -> None:
        """Replace the CFM start-noise buffer (``[1, 80, F]``, any F >= the frames a stream needs)."""
        if noise.dim() != 3 or noise.shape[:2] != (1, self.n_mels):
            raise ValueError(f"noise must be [1, {self.n_mels}, frames], got {tuple(noise.shape)}")
        self.rand_noise = noise.to(device=self.rand_noise.device, dtype=torch.float32)

    def project_speaker(self, embedding: Tensor) -> Tensor:
        """``[B, spk_embed_dim]`` raw speaker embedding (CAM++) -> ``[B, 80]`` (L2-normalise, affine)."""
        if embedding.dim() != 2 or embedding.shape[1] != self.cfg.spk_embed_dim:
            raise ValueError(f"speaker embedding must be [B, {self.cfg.spk_embed_dim}], got {tuple(embedding.shape)}")
        p = self.spk_embed_affine_layer.weight  # (a host embedding is copied without a device sync)
        return self.spk_embed_affine_layer(F.normalize(_to_device(embedding, p.device).to(p.dtype), dim=1))

    def _check_host_tokens(self, tokens: Tensor) -> Tensor:
        """``tokens`` ``[L]`` as int64 where they are (on the host: no device sync); raises ValueError
        unless 1-D and within the vocabulary."""
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got {tuple(tokens.shape)}")
        tokens = tokens.to(torch.long)
        if tokens.numel() and (int(tokens.max()) >= self.cfg.vocab_size or int(tokens.min()) < 0):
            raise ValueError(f"speech token out of range [0, {self.cfg.vocab_size})")
        return tokens

    def _check_tokens(self, tokens: Tensor) -> Tensor:
        """``tokens`` ``[L]`` as int64 on the flow's device, range-checked (ValueError); the check of a
        device tensor waits for the device (prefer host tokens: :meth:`_check_host_tokens`)."""
        return _to_device(self._check_host_tokens(tokens), self.input_embedding.weight.device)

    # ------------------------------------------------------------------ encoder (streaming form)

    def _conformer_stack(self, layers, x: Tensor, caches: list[Tensor | None], cache_len: list[int], new_len: list[int]):
        """Run conformer ``layers`` on ``x [B, Tmax, D]`` with per-stream caches; returns x and the new
        per-layer kv ``[B, H, Cmax + Tmax, 2dk]`` (padded layout) plus (Cmax, Tmax)."""
        b, tmax, d = x.shape
        cmax = max(cache_len)
        uniform = len(set(cache_len)) == 1 and len(set(new_len)) == 1
        mask = None
        if not uniform:
            j = torch.arange(cmax + tmax, device=x.device).view(1, -1)
            lo = _ints([cmax - c for c in cache_len], x.device).view(-1, 1)
            hi = _ints([cmax + n for n in new_len], x.device).view(-1, 1)
            mask = ((j >= lo) & (j < hi)).view(b, 1, 1, -1)
        pos = relative_position_table(cmax + tmax, d, x.device, x.dtype)
        new = []
        for layer, cache in zip(layers, caches):
            a, kv = layer.self_attn.forward_after_cache(layer.norm_mha(x), pos, cache, mask)
            x = x + a
            x = x + layer.feed_forward(layer.norm_ff(x))
            new.append(kv)
        return x, new

    @staticmethod
    def _left_aligned(caches: Sequence[Tensor | None], lens: Sequence[int], cmax: int) -> Tensor:
        """Per-item layer caches ``[L, 1, H, C_b, E]`` (None where ``C_b`` = 0) -> ``[L, B, H, cmax, E]``
        with item b's cache at the end of its row (zeros before it), as one concatenation and one
        ``index_select`` for the whole batch (the index is built on the host; no per-item copies).
        Needs ``cmax >= max(lens) > 0``. The result is a permuted view (layers first)."""
        present = [c for c, n in zip(caches, lens) if n > 0]
        ref = present[0]
        n_layers, _, heads, _, width = ref.shape
        zero = ref.new_zeros(n_layers, 1, heads, 1, width)  # frame 0: what the padding reads
        flat = torch.cat([zero, *_merge_adjacent(present, 3)], dim=3)  # [L, 1, H, 1 + sum C_b, E]
        idx, at = [], 1
        for n in lens:
            idx += [0] * (cmax - n)
            idx += range(at, at + n)
            at += n
        g = flat.index_select(3, _ints(idx, flat.device))  # [L, 1, H, B * cmax, E]
        return g.view(n_layers, heads, len(lens), cmax, width).transpose(1, 2)

    @staticmethod
    def _item_frames(kvs: Sequence[Tensor] | Tensor, rows: list[int], frames: list[int],
                     sizes: list[int]) -> list[Tensor]:
        """From per-layer key/value outputs ``[B, H, S, E]`` (a list, or stacked ``[L, B, H, S, E]``)
        gather, for each kept item, its frames
        (``frames`` indexes S, ``rows`` the item of each frame; ``sizes`` frames per item, in order):
        one stack and one gather for the batch, then per item a contiguous ``[L, 1, H, n_b, E]`` copy
        in a storage of its own (a view would keep the whole batch's gather alive while any item
        holds it)."""
        if not sizes:
            return []
        stacked = kvs if isinstance(kvs, Tensor) else torch.stack(list(kvs))  # [L, B, H, S, E]
        ix = _ints(rows + frames, stacked.device)
        g = stacked[:, ix[: len(rows)], :, ix[len(rows):]]  # [N, L, H, E]
        return [_own(t) for t in g.permute(1, 2, 0, 3).unsqueeze(1).split(sizes, dim=3)]

    def _token_lists(self, items: Sequence[DitItem],
                     check_device: bool) -> tuple[list[list[int] | None], dict[int, Tensor], list[int]]:
        """The items' tokens: per item a list of Python ints (host tensors, range-checked) or None,
        the int64 device tensors of the others (``{item: tokens}``, checked with :meth:`_check_tokens`
        when ``check_device``), and every item's token count. Raises ValueError (1-D tokens,
        vocabulary range)."""
        vocab = self.cfg.vocab_size
        host: list[list[int] | None] = []
        other: dict[int, Tensor] = {}
        for i, it in enumerate(items):
            t = it.tokens
            if t.dim() != 1:
                raise ValueError(f"tokens must be 1-D, got {tuple(t.shape)}")
            if t.device.type == "cpu":
                vals = (t if t.dtype == torch.long else t.to(torch.long)).tolist()
                if vals and (max(vals) >= vocab or min(vals) < 0):
                    raise ValueError(f"speech token out of range [0, {vocab})")
                host.append(vals)
            else:
                other[i] = self._check_tokens(t) if check_device else t.to(torch.long)
                host.append(None)
        lens = [len(v) if v is not None else int(other[i].numel()) for i, v in enumerate(host)]
        return host, other, lens

    def _encoder_frames(self, items: Sequence[DitItem], lens: Sequence[int]) -> list[int]:
        """Encoder frames per item: its token count, less the look-ahead for a non-final item.
        Raises ValueError for an item that produces no frame."""
        la = self.pre_lookahead_len
        tlen = [n if it.last else n - la for n, it in zip(lens, items)]
        for n, t, it in zip(lens, tlen, items):
            if t < 1:
                raise ValueError(f"a {'final' if it.last else 'non-final'} chunk of {n} tokens produces no frame "
                                 f"(non-final chunks need more than the {la} look-ahead tokens)")
        return tlen

    def _token_matrix(self, items: Sequence[DitItem], check_device: bool = True,
                      lists: tuple | None = None) -> tuple[Tensor, list[int]]:
        """The items' tokens right-padded with 0 into ``[B, Lmax]`` int64 on the module's device, and
        their counts. Host (CPU) token tensors are checked and padded as Python ints and moved with
        one copy (no per-item tensor work); tokens already on another device are copied per item,
        checked with :meth:`_check_tokens` when ``check_device`` (its range check synchronises with
        that device). ``lists``: :meth:`_token_lists` of the items, when the caller has it. Raises
        ValueError (1-D tokens, vocabulary range)."""
        dev = self.input_embedding.weight.device
        host, other, lens = self._token_lists(items, check_device) if lists is None else lists
        lmax = max(lens)
        tok = _ints(_right_padded(host, lmax), dev).view(len(items), lmax)
        for i, t in other.items():
            tok[i, : lens[i]] = t
        return tok, lens

    def _encode(self, items: Sequence[DitItem], trim_keep: int | None = None,
                keep_state: Sequence[bool] | None = None, check_device_tokens: bool = False,
                token_lists: tuple | None = None):
        """Encoder + projection for a batch of items -> ``(mu [B, Mmax, 80], frames per item, new enc
        caches)``: per item ``(enc_att1, enc_att2, enc_lookahead, enc_up)`` (tensors of their own),
        already trimmed as :func:`trim_state` would when ``trim_keep`` is given; None for items with
        ``keep_state[i]`` False (not gathered). Host tokens are always range-checked, tokens on the
        device only with ``check_device_tokens`` (see :meth:`_token_matrix`); ``token_lists``: the
        items' :meth:`_token_lists` when the caller has them (checked already)."""
        enc = self.encoder
        la = self.pre_lookahead_len
        stride = self.up_rate
        dev = self.input_embedding.weight.device
        tok, lens = self._token_matrix(items, check_device_tokens, token_lists)
        tlen = self._encoder_frames(items, lens)
        lmax, tmax = max(lens), max(tlen)
        x = enc.embed(self.input_embedding(tok))  # [B, Lmax, D] (padded rows hold garbage past L_b)
        keep = torch.arange(lmax, device=dev).view(1, -1) < _ints(lens, dev).view(-1, 1)
        x = torch.where(keep.unsqueeze(-1), x, x.new_zeros(()))
        d = x.size(-1)

        # look-ahead layer (a final item reads la zeros past its end); convolutions time-major (_conv_tc)
        pl = enc.pre_lookahead_layer
        k2 = pl.conv2.kernel_size[0] - 1
        h1 = F.leaky_relu(_conv_tc(pl.conv1, F.pad(x, (0, 0, 0, la))))  # [B, Lmax, D]; item b: tlen[b] frames
        la_cache = _cat([it.state.enc_lookahead if it.state is not None else x.new_zeros(1, d, k2) for it in items], 0)
        tl = _ints(tlen, dev)
        h1c = torch.cat([la_cache.to(h1).transpose(1, 2), h1], dim=1)  # [B, k2 + Lmax, D]
        new_la = _last_frames_tc(h1c, k2, None if len(set(tlen)) == 1 and tlen[0] == h1.size(1) else tl)
        h = _conv_tc(pl.conv2, h1c)[:, :tmax] + x[:, :tmax]

        # first conformer stage
        c1 = [0 if it.state is None else int(it.state.enc_att1.shape[3]) for it in items]
        c1max = max(c1)
        caches = [None] * len(enc.encoders)
        if c1max > 0:
            caches = list(self._left_aligned([None if it.state is None else it.state.enc_att1 for it in items],
                                             c1, c1max))
        h, kv1 = self._conformer_stack(enc.encoders, h, caches, c1, tlen)

        # upsampling (nearest x stride, causal conv with a 2*stride cache)
        up = enc.up_layer
        hu = h.repeat_interleave(stride, dim=1)  # [B, stride * Tmax, D]: nearest-neighbour upsampling
        up_cache = _cat([it.state.enc_up if it.state is not None else x.new_zeros(1, d, 2 * stride) for it in items], 0)
        huc = torch.cat([up_cache.to(hu).transpose(1, 2), hu], dim=1)
        mlen = [stride * t for t in tlen]
        new_up = _last_frames_tc(huc, 2 * stride, None if len(set(mlen)) == 1 and mlen[0] == hu.size(1)
                                 else _ints(mlen, dev))
        h = enc.up_embed(_conv_tc(up.conv, huc))

        c2 = [stride * c for c in c1]
        c2max = max(c2)
        caches = [None] * len(enc.up_encoders)
        if c2max > 0:
            caches = list(self._left_aligned([None if it.state is None else it.state.enc_att2 for it in items],
                                             c2, c2max))
        h, kv2 = self._conformer_stack(enc.up_encoders, h, caches, c2, mlen)
        mu = self.encoder_proj(enc.after_norm(h))
        return mu, mlen, self._enc_caches(items, kv1, kv2, new_la, new_up, c1, tlen, c1max, c2max, trim_keep,
                                          keep_state)

    def _enc_caches(self, items: Sequence[DitItem], kv1, kv2, new_la: Tensor, new_up: Tensor, c1: list[int],
                    tlen: list[int], c1max: int, c2max: int, trim_keep: int | None,
                    keep_state: Sequence[bool] | None) -> list[tuple | None]:
        """The new encoder caches of a batch's kept items from the encoder's padded outputs.

        ``kv1`` / ``kv2``: per-layer keys ‖ values of the two conformer stages, a list of ``[B', H,
        c1max + T, 2dk]`` / ``[B', H, c2max + up*T, 2dk]`` or one stacked ``[L, B', H, ., 2dk]``
        tensor (``B' >= B`` rows, item b's cache left-aligned to end at ``c1max`` / ``c2max``, its
        new frames after it); ``new_la [B', D, 2]``, ``new_up [B', D, 2*stride]``; ``c1`` / ``tlen``:
        per item first-stage cache length and encoder frames (host ints; the second stage's are
        ``up_rate`` times them). Returns per item ``(enc_att1, enc_att2, enc_lookahead, enc_up)``
        (each tensor in a storage of its own, see :meth:`_item_frames`), trimmed as :func:`trim_state`
        trims when ``trim_keep`` is given; None for items with ``keep_state[i]`` False."""
        b, stride = len(items), self.up_rate
        # each item's frames of the padded layout (cache ++ new), trimmed on upstream's layout (see
        # trim_state), gathered for the whole batch at once
        kept = [i for i in range(b) if keep_state is None or keep_state[i]]
        rows1, fr1, n1s, rows2, fr2, n2s = [], [], [], [], [], []
        for i in kept:
            n1, n2 = c1[i] + tlen[i], stride * (c1[i] + tlen[i])
            it = items[i]
            p = it.prompt_frames if it.state is None else it.state.prompt_frames
            base1, base2 = c1max - c1[i], c2max - stride * c1[i]
            if trim_keep is not None and n2 > p + trim_keep:
                sel2 = [*range(base2, base2 + p), *range(base2 + n2 - trim_keep, base2 + n2)]
                sel1 = [base1 + (j - base2) % n1 for j in sel2[: (p + trim_keep) // 2]]
            else:
                sel1, sel2 = range(base1, base1 + n1), range(base2, base2 + n2)
            fr1 += sel1
            fr2 += sel2
            rows1 += [i] * len(sel1)
            rows2 += [i] * len(sel2)
            n1s.append(len(sel1))
            n2s.append(len(sel2))
        a1 = self._item_frames(kv1, rows1, fr1, n1s)
        a2 = self._item_frames(kv2, rows2, fr2, n2s)
        new_caches: list[tuple | None] = [None] * b
        for k, i in enumerate(kept):
            new_caches[i] = (a1[k], a2[k], _own(new_la[i: i + 1]), _own(new_up[i: i + 1]))
        return new_caches

    # ------------------------------------------------------------------ encoder, padded static form

    def encoder_bucket(self, frames: int, cache: int) -> tuple[int, int]:
        """The padded encoder shape that serves a solve bucket of ``frames`` mel frames and ``cache``
        estimator cache frames: ``(encoder frames tb, first-stage cache c1b)`` = ``(ceil(frames /
        up_rate), ceil(cache / up_rate))`` (tokens ``tb + pre_lookahead_len``, second-stage cache
        ``up_rate * c1b``). Every batch the solve pads to that bucket fits it: its mel frames are
        ``up_rate`` x its encoder frames, and a stream's estimator cache and its encoder's second
        stage cache have the same length (``up_rate`` x the first stage's; both grow by the chunk's
        mel frames and are trimmed by the same rule, :func:`trim_state`)."""
        up = self.up_rate
        return -(-frames // up), -(-cache // up)

    def _encoder_shapes(self, bb: int, tb: int, c1b: int, dtype: torch.dtype) -> dict[str, tuple[tuple, torch.dtype]]:
        """``name -> (shape, dtype)`` of the static tensors of :meth:`_encode_static` for ``bb`` rows,
        ``tb`` encoder frames and a first-stage cache of ``c1b`` frames (``lb = tb + la`` tokens):

        * ``enc_ints [bb * lb + 3 * bb]`` int64: the token matrix ``[bb, lb]`` (right-padded with 0),
          then per row its token count, encoder frames and first-stage cache length;
        * ``enc_la [bb, D, k-1]`` / ``enc_up [bb, D, 2 * up]``: look-ahead layer and upsampler caches;
        * ``enc_kv1 [num_blocks, bb, H, c1b + tb, 2dk]`` / ``enc_kv2 [num_up_blocks, bb, H, up * (c1b +
          tb), 2dk]``: keys ‖ values, each row's cache left-aligned to end at ``c1b`` / ``up * c1b``
          (written before a run), its new frames after it (written by the run);
        * outputs ``enc_new_la`` / ``enc_new_up`` (shapes of ``enc_la`` / ``enc_up``)."""
        enc = self.encoder
        d = enc.output_size
        att = enc.encoders[0].self_attn if len(enc.encoders) else enc.up_encoders[0].self_attn
        heads, width = att.h, 2 * att.d_k
        up, lb = self.up_rate, tb + self.pre_lookahead_len
        k1 = enc.pre_lookahead_layer.conv2.kernel_size[0] - 1
        return {"enc_ints": ((bb * lb + 3 * bb,), torch.long),
                "enc_la": ((bb, d, k1), dtype),
                "enc_up": ((bb, d, 2 * up), dtype),
                "enc_kv1": ((len(enc.encoders), bb, heads, c1b + tb, width), dtype),
                "enc_kv2": ((len(enc.up_encoders), bb, heads, up * (c1b + tb), width), dtype),
                "enc_new_la": ((bb, d, k1), dtype),
                "enc_new_up": ((bb, d, 2 * up), dtype)}

    def _encoder_dims(self, bufs: dict) -> tuple[int, int, int, int]:
        """``(bb, lb, tb, c1b)`` of the static encoder tensors in ``bufs`` (see :meth:`_encoder_shapes`)."""
        kv1 = bufs["enc_kv1"]
        bb = kv1.shape[1]
        lb = bufs["enc_ints"].numel() // bb - 3
        tb = lb - self.pre_lookahead_len
        return bb, lb, tb, kv1.shape[3] - tb

    def _encoder_fits(self, bufs: dict, lens: Sequence[int], c1: Sequence[int]) -> bool:
        """Whether a batch (token counts, first-stage cache lengths) fits the static tensors in ``bufs``."""
        bb, lb, _, c1b = self._encoder_dims(bufs)
        return len(lens) <= bb and max(lens) <= lb and max(c1) <= c1b

    def _encoder_inputs(self, items: Sequence[DitItem], bufs: dict, host: list, other: dict[int, Tensor],
                        lens: list[int], tlen: list[int], c1: list[int]) -> None:
        """Write a batch's encoder inputs into the static tensors ``bufs`` (:meth:`_encoder_shapes`; the
        batch must fit: :meth:`_encoder_fits`). Host work only plus batched copies: one host-to-device
        transfer of every index (token matrix, lengths, the caches' target rows and frames), one
        copy into ``enc_ints``, one concatenation + one indexed copy per attention cache kind
        (item b's cache left-aligned in its row), one concatenation + copy per convolution cache.
        Padding rows get one token, one frame and no cache (finite values nobody reads); cache
        frames left of an item's cache keep whatever they hold (masked, never read)."""
        bb, lb, _, c1b = self._encoder_dims(bufs)
        up, b = self.up_rate, len(items)
        kv1, kv2 = bufs["enc_kv1"], bufs["enc_kv2"]
        dev = kv1.device
        pad = bb - b
        flat = _right_padded(host, lb)
        flat += [0] * (lb * pad)
        flat += lens
        flat += [1] * pad
        flat += tlen
        flat += [1] * pad
        flat += c1
        flat += [0] * pad
        n_ints = len(flat)
        src = [i for i in range(b) if c1[i] > 0]
        n1 = sum(c1[i] for i in src)
        for i in src:  # rows, then frames, of every cached first-stage frame; then the second stage's
            flat += [i] * c1[i]
        for i in src:
            flat += range(c1b - c1[i], c1b)
        for i in src:
            flat += [i] * (up * c1[i])
        for i in src:
            flat += range(up * (c1b - c1[i]), up * c1b)
        ix = _ints(flat, dev)
        ints = bufs["enc_ints"]
        ints.copy_(ix[:n_ints])
        for i, t in other.items():
            ints[i * lb: i * lb + lens[i]].copy_(t)
        if n1:
            a, n2 = n_ints, up * n1
            states = [items[i].state for i in src]
            k1 = _cat([s.enc_att1 for s in states], 3)[:, 0]  # [L1, H, n1, E]
            kv1[:, ix[a: a + n1], :, ix[a + n1: a + 2 * n1]] = k1.permute(2, 0, 1, 3).to(kv1.dtype)
            a += 2 * n1
            k2 = _cat([s.enc_att2 for s in states], 3)[:, 0]  # [L2, H, n2, E]
            kv2[:, ix[a: a + n2], :, ix[a + n2: a + 2 * n2]] = k2.permute(2, 0, 1, 3).to(kv2.dtype)
        for name, attr in (("enc_la", "enc_lookahead"), ("enc_up", "enc_up")):
            buf = bufs[name]
            if any(it.state is not None for it in items):
                zero = buf.new_zeros(1, *buf.shape[1:]) if any(it.state is None for it in items) else None
                buf[:b].copy_(_cat([getattr(it.state, attr) if it.state is not None else zero for it in items], 0))
            else:
                buf[:b].zero_()

    def _static_stack(self, layers, x: Tensor, kv: Tensor, cb: int, cache_len: Tensor, new_len: Tensor) -> Tensor:
        """Conformer ``layers`` over ``x [bb, T, D]`` with every row's keys ‖ values in ``kv [L, bb, H,
        cb + T, 2dk]`` (its cache left-aligned to end at ``cb``; the layer's new keys/values are
        written **in place** into frames ``cb ..``), ``cache_len`` / ``new_len [bb]`` int64 (valid
        cached / new frames per row, as tensors: fixed shapes, no host sync). Query ``i`` sits at
        position ``cb + i``, key ``j`` at ``j`` (the relative-position scores of
        :meth:`~cosyserve.models.flow_encoder.RelPositionSelfAttention.forward_after_cache`); keys
        outside ``[cb - cache_len, cb + new_len)`` are masked. Returns ``x [bb, T, D]``."""
        b, t, d = x.shape
        s = cb + t
        j = torch.arange(s, device=x.device).view(1, -1)
        mask = ((j >= cb - cache_len.view(-1, 1)) & (j < cb + new_len.view(-1, 1))).view(b, 1, 1, s)
        pos = relative_position_table(s, d, x.device, x.dtype)
        for layer, buf in zip(layers, kv):
            att = layer.self_attn
            dk = att.d_k
            q_u, q_v, k, v, p, scale = att._project(layer.norm_mha(x), pos)
            buf[:, :, cb:, :dk].copy_(k)
            buf[:, :, cb:, dk:].copy_(v)
            bias = att._shift(torch.matmul(q_v, p.transpose(-2, -1)), s) * scale
            bias = bias.masked_fill(~mask, float("-inf"))
            out = F.scaled_dot_product_attention(q_u, buf[..., :dk], buf[..., dk:], attn_mask=bias, scale=scale)
            x = x + att.linear_out(out.transpose(1, 2).reshape(b, t, -1))
            x = x + layer.feed_forward(layer.norm_ff(x))
        return x

    def _encode_static(self, bufs: dict) -> Tensor:
        """The streaming encoder + projection of :meth:`_encode` in fixed shapes (what a CUDA graph of
        the encoder captures): every per-row difference (token counts, final or not, cache lengths,
        padding rows) comes from the tensors of ``bufs`` (:meth:`_encoder_shapes`, written by
        :meth:`_encoder_inputs`), with no Python branching on their values, no host synchronisation
        and no data-dependent allocation. Algorithm: Step-Audio2 token2wav's streaming
        ``UpsampleConformerEncoderV2`` (see the module docstring); per row the same operations as
        :meth:`_encode`, so results equal it up to float summation order.

        Writes the new keys/values into ``enc_kv1`` / ``enc_kv2`` (frames after each cache), the
        new convolution caches into ``enc_new_la`` / ``enc_new_up``; returns ``mu [bb, up * tb, 80]``
        in the module's dtype (row b valid for its first ``up * tlen_b`` frames)."""
        enc = self.encoder
        la, up = self.pre_lookahead_len, self.up_rate
        bb, lb, tb, c1b = self._encoder_dims(bufs)
        ints = bufs["enc_ints"]
        tok = ints[: bb * lb].view(bb, lb)
        lens, tlen, c1 = ints[bb * lb:].view(3, bb)
        x = enc.embed(self.input_embedding(tok))  # [bb, lb, D]
        keep = torch.arange(lb, device=x.device).view(1, -1) < lens.view(-1, 1)
        x = torch.where(keep.unsqueeze(-1), x, x.new_zeros(()))

        pl = enc.pre_lookahead_layer  # a final row reads la zeros past its end
        h1 = F.leaky_relu(_conv_tc(pl.conv1, F.pad(x, (0, 0, 0, la))))  # [bb, lb, D]
        h1c = torch.cat([bufs["enc_la"].transpose(1, 2), h1], dim=1)
        bufs["enc_new_la"].copy_(_last_frames_tc(h1c, bufs["enc_la"].shape[2], tlen))
        h = _conv_tc(pl.conv2, h1c)[:, :tb] + x[:, :tb]
        h = self._static_stack(self.encoder.encoders, h, bufs["enc_kv1"], c1b, c1, tlen)

        hu = h.repeat_interleave(up, dim=1)  # nearest-neighbour upsampling
        huc = torch.cat([bufs["enc_up"].transpose(1, 2), hu], dim=1)
        mlen = tlen * up
        bufs["enc_new_up"].copy_(_last_frames_tc(huc, 2 * up, mlen))
        h = enc.up_embed(_conv_tc(enc.up_layer.conv, huc))
        h = self._static_stack(enc.up_encoders, h, bufs["enc_kv2"], up * c1b, c1 * up, mlen)
        return self.encoder_proj(enc.after_norm(h))

    def _encode_graph_body(self, bufs: dict) -> None:
        """:meth:`_encode_static`, then ``mu`` into the conditional rows of the solve's ``static_in``
        (``[2bb, 240, M]``, channels ``[:80]``, its first ``M`` frames): what a bucket's encoder graph
        records (:class:`GraphedDiTSolve`)."""
        mu = self._encode_static(bufs)
        static_in = bufs["static_in"]
        static_in[0::2, : self.n_mels].copy_(mu[:, : static_in.shape[2]].transpose(1, 2))

    def _encoder_fill(self, bufs: dict) -> None:
        """Valid placeholder inputs in fresh static encoder tensors (graph warm-ups): zero tokens, every
        row at its full token count, frames and cache."""
        bb, lb, tb, c1b = self._encoder_dims(bufs)
        ints = bufs["enc_ints"]
        ints.zero_()
        rows = ints[bb * lb:].view(3, bb)
        rows[0].fill_(lb)
        rows[1].fill_(tb)
        rows[2].fill_(c1b)

    @torch.inference_mode()
    def _encode_padded(self, items: Sequence[DitItem], frames: int | None = None, cache: int | None = None,
                       rows: int | None = None, trim_keep: int | None = None,
                       keep_state: Sequence[bool] | None = None, check_device_tokens: bool = False):
        """:meth:`_encode` through the padded static form, run eagerly on fresh tensors: the batch is
        padded to ``rows`` items (default: its count) and the encoder bucket of a solve bucket of
        ``frames`` mel frames and ``cache`` estimator cache frames (:meth:`encoder_bucket`; default:
        the batch's own). Returns what :meth:`_encode` returns: ``(mu [B, Mmax, 80], frames per item,
        new caches)`` (equal to it up to float summation order). Raises ValueError as :meth:`_encode`
        and when the batch does not fit the bucket. For tests and host-work measurements; serving
        runs the form as a CUDA graph (:class:`GraphedDiTSolve`)."""
        lists = self._token_lists(items, check_device_tokens)
        tlen = self._encoder_frames(items, lists[2])
        c1 = [0 if it.state is None else int(it.state.enc_att1.shape[3]) for it in items]
        up = self.up_rate
        tb, c1b = self.encoder_bucket(up * max(tlen) if frames is None else frames,
                                      up * max(c1) if cache is None else cache)
        bb = len(items) if rows is None else rows
        if len(items) > bb or max(tlen) > tb or max(c1) > c1b:
            raise ValueError(f"batch of {len(items)} items, {max(tlen)} frames, cache {max(c1)} does not fit the "
                             f"encoder bucket ({bb} rows, {tb} frames, cache {c1b})")
        mu, caches = self._encode_padded_run(items, lists, tlen, c1, bb, tb, c1b, trim_keep, keep_state)
        mlen = [up * t for t in tlen]
        return mu[: len(items), : max(mlen)], mlen, caches

    def _encode_padded_run(self, items: Sequence[DitItem], lists: tuple, tlen: list[int], c1: list[int], bb: int,
                           tb: int, c1b: int, trim_keep: int | None,
                           keep_state: Sequence[bool] | None) -> tuple[Tensor, list[tuple | None]]:
        """:meth:`_encode_static` eagerly on fresh tensors of the bucket ``(bb, tb, c1b)`` (which the
        batch fits) -> ``(mu [bb, up * tb, 80], new caches as :meth:`_enc_caches`)``; ``lists``:
        the items' :meth:`_token_lists`, ``tlen`` / ``c1``: encoder frames and first-stage caches."""
        host, other, lens = lists
        bufs = {name: torch.zeros(shape, dtype=dt, device=self.input_embedding.weight.device)
                for name, (shape, dt) in self._encoder_shapes(bb, tb, c1b, self.encoder_proj.weight.dtype).items()}
        self._encoder_inputs(items, bufs, host, other, lens, tlen, c1)
        mu = self._encode_static(bufs)
        caches = self._enc_caches(items, bufs["enc_kv1"], bufs["enc_kv2"], bufs["enc_new_la"], bufs["enc_new_up"],
                                  c1, tlen, c1b, self.up_rate * c1b, trim_keep, keep_state)
        return mu, caches

    # ------------------------------------------------------------------ CFM with the DiT

    def _time_conditioning(self, n_timesteps: int, dtype: torch.dtype, dev,
                           cache: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(t [S], dt [S], mod_blocks, mod_final)`` of a solve (see :meth:`DiT.modulations`): the
        cosine grid ``t_k = 1 - cos(k/S * pi/2)`` walked with upstream's accumulated ``t <- t + dt``,
        ``dt = t_span[k+1] - t`` in float32, and the estimator's time conditioning at each ``t``.
        Cached per (steps, dtype, device) until a parameter it depends on changes; ``cache=False``
        (graph warm-ups in a capture thread, on another stream) neither reads nor writes the cache."""
        est = self.decoder.estimator
        params = [*est.t_embedder.parameters(), *est.final_layer.adaLN_modulation.parameters()]
        for blk in est.blocks:
            params += list(blk.adaLN_modulation.parameters())
        key = (n_timesteps, dtype, torch.device(dev), tuple((p.data_ptr(), p._version) for p in params))
        if cache and self._tc_cache is not None and self._tc_cache[0] == key:
            return self._tc_cache[1]
        t_span = torch.linspace(0, 1, n_timesteps + 1, device=dev, dtype=torch.float32)
        t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
        ts, dts = [], []
        t, dt = t_span[0:1], t_span[1:2] - t_span[0:1]
        for step in range(1, n_timesteps + 1):
            ts.append(t)
            dts.append(dt)
            t = t + dt
            if step < n_timesteps:
                dt = t_span[step + 1] - t
        ts, dts = torch.cat(ts), torch.cat(dts)
        blocks, final = est.modulations(ts.to(dtype))
        if not cache:
            return ts, dts, blocks, final
        self._tc_cache = (key, (ts, dts, blocks, final))
        return self._tc_cache[1]

    def _padded_noise(self) -> Tensor:
        """``rand_noise[0]`` followed by one zero frame: ``[80, F + 1]`` float32 (what padded frames
        and padding rows start from), rebuilt when :attr:`rand_noise` is replaced (:meth:`set_noise`,
        a move to another device)."""
        noise = self.rand_noise
        if self._noise_pad is None or self._noise_pad[0] is not noise:
            self._noise_pad = (noise, F.pad(noise[0], (0, 1)))
        return self._noise_pad[1]

    def _solve_shapes(self, b: int, mmax: int, cmax: int, n_timesteps: int,
                      dtype: torch.dtype) -> dict[str, tuple[tuple, torch.dtype]]:
        """``name -> (shape, dtype)`` of every tensor :meth:`_euler` reads or writes for ``b`` items,
        ``mmax`` frames and ``cmax`` cache frames (the estimator in ``dtype``; ODE state float32)."""
        d = self.decoder.estimator.cfg
        n, k1, f32 = 2 * b, d.conv_kernel_size - 1, torch.float32
        return {"att": ((n_timesteps, d.depth, n, d.num_heads, mmax + cmax, 2 * d.head_dim), dtype),
                "cnn_in": ((n_timesteps, d.depth, n, 2 * d.hidden_size, k1), dtype),
                "cnn_out": ((n_timesteps, d.depth, n, 2 * d.hidden_size, k1), dtype),
                "x0": ((b, self.n_mels, mmax), f32),
                "static_in": ((n, 3 * self.n_mels, mmax), dtype),
                "x_out": ((b, self.n_mels, mmax), f32),
                "mask": ((n, 1, 1, mmax + cmax), torch.bool),
                "new_len": ((n,), torch.long),
                "dt": ((n_timesteps,), f32),
                "mod_blocks": ((n_timesteps, d.depth, 1, 1, 9 * d.hidden_size), dtype),
                "mod_final": ((n_timesteps, 1, 1, 2 * d.hidden_size), dtype)}

    def _solve_buffers(self, b: int, mmax: int, cmax: int, n_timesteps: int, dtype: torch.dtype, dev) -> dict:
        """Fresh inputs/outputs of :meth:`_euler` for ``b`` items (eager solves): the state and cache
        tensors of :meth:`_solve_shapes` (inputs zeroed), no mask and lengths (set by the caller, as
        are the time conditioning's)."""
        shapes = self._solve_shapes(b, mmax, cmax, n_timesteps, dtype)
        bufs = {name: (torch.empty if name in ("cnn_out", "x_out") else torch.zeros)(shape, dtype=dt, device=dev)
                for name, (shape, dt) in shapes.items()
                if name in ("x0", "static_in", "att", "cnn_in", "cnn_out", "x_out")}
        bufs.update(mask=None, new_len=None)
        return bufs

    def _euler(self, bufs: dict, n_timesteps: int) -> None:
        """The Euler/CFG solve on the tensors of ``bufs`` (the function a CUDA graph captures).

        Reads ``x0 [B, 80, M]`` float32 (start noise), ``static_in [2B, 240, M]`` (``mu ‖ spk ‖ cond``,
        rows (conditional, unconditional) per item), ``cnn_in [S, depth, 2B, 2h, k-1]``, ``mask``,
        ``new_len``, the step sizes ``dt [S]`` and the time conditioning ``mod_blocks`` / ``mod_final``
        (:meth:`_time_conditioning`); updates ``att [S, depth, 2B, H, M + C, 2hd]`` in place (step ``k``'s new keys/values
        in front of its cache) and writes ``x_out`` (the mel, float32) and ``cnn_out``."""
        est = self.decoder.estimator
        x, static_in = bufs["x0"], bufs["static_in"]
        att, cnn, mask, new_len = bufs["att"], bufs["cnn_in"], bufs["mask"], bufs["new_len"]
        dts, mod_blocks, mod_final = bufs["dt"], bufs["mod_blocks"], bufs["mod_final"]
        b, n_mels, mmax = x.shape
        dtype = static_in.dtype
        r = self.cfg.inference_cfg_rate
        # the key mask as an additive bias once per solve (SDPA would convert a boolean mask in every
        # layer of every step)
        bias = None if mask is None else attention_bias(mask, dtype)
        last_idx = est.conv_last_idx(new_len)
        inp = _estimator_input(x, static_in)
        for step in range(n_timesteps):
            v, _ = est(inp, None, att[step], cnn[step], bias, new_len, mods=(mod_blocks[step], mod_final[step]),
                       last_idx=last_idx, cnn_out=bufs["cnn_out"][step])  # (new conv caches written there)
            x, inp = _CFG_EULER(x, v, dts[step], static_in, r)  # (the last step's inp is not read)
        bufs["x_out"].copy_(x)

    def _solve_bucket(self, items: Sequence[DitItem], mlen: list[int], n_timesteps: int, dtype: torch.dtype,
                      dev) -> tuple[int, int, int, tuple | None]:
        """The padded solve shape of a batch ``(rows, frames, cache frames)`` and its published graph
        entry (or None: eager), counted in :attr:`GraphedDiTSolve.used`; without :attr:`graph` the
        batch's own shape and None. Raises ValueError for states with too few steps' caches or
        streams longer than the noise buffer."""
        ce = [0 if it.state is None else it.state.cache_frames for it in items]
        for i, it in enumerate(items):
            if it.state is not None and it.state.stale:
                raise ValueError("stream state is stale: a later chunk of this stream wrote its caches in place "
                                 "(pass the stream's newest state)")
            if it.state is not None and it.state.est_att.shape[0] < n_timesteps:
                raise ValueError(f"stream state holds caches for {it.state.est_att.shape[0]} steps, {n_timesteps} asked")
            if ce[i] + mlen[i] > self.rand_noise.size(-1):
                raise ValueError(f"DiT flow: {ce[i] + mlen[i]} frames exceed the noise buffer of {self.rand_noise.size(-1)}")
        graph = self.graph
        b, mmax, cmax = len(items), max(mlen), max(ce)
        if graph is None:
            return b, mmax, cmax, None
        # with graphs the item count is padded too (fewer distinct graphs); a padding item has one valid
        # frame and no cache, so its rows compute finite garbage that is never read
        key = (graph.rows_bucket(b), graph.solve_frames_bucket(mmax, cmax), graph.cache_bucket(cmax))
        graph.used[key] += 1
        return (*key, graph.solve_entry(key, n_timesteps, dtype, dev))

    def _solve(self, items: Sequence[DitItem], mu: Tensor | None, mlen: list[int], n_timesteps: int,
               trim_keep: int | None = None, keep_state: Sequence[bool] | None = None,
               bucket: tuple[int, int, int, tuple | None] | None = None, write_back: CacheWriteBack | None = None):
        """Euler/CFG solve over the batch; returns (mel [B, 80, Mmax], per-item (est_att, est_cnn, store,
        generation) or None; store None and generation 0 for items not :attr:`DitItem.in_place`).

        ``bucket``: :meth:`_solve_bucket` of the batch when the caller has it already. ``mu`` None:
        the bucket's graph entry holds an encoder graph whose inputs the caller has written
        (:meth:`_encode_solve`); it is replayed first and writes ``mu`` into the solve's inputs.

        The ODE state ``x`` and the time grid stay float32 (the estimator runs in the module's dtype).
        With :attr:`graph` set, rows, frames and cache lengths are padded to the graph's buckets (masked)
        and the whole solve replays the bucket's CUDA graph when it is published
        (:meth:`GraphedDiTSolve.solve_entry`); otherwise the padded solve runs eagerly. Each item's new
        estimator cache is gathered from the batch's key/value buffer in one copy, already trimmed to
        ``[:P] ++ [-trim_keep:]`` when ``trim_keep`` is given (the driver's rule, see :func:`trim_state`);
        items with ``keep_state[i]`` False get None. In-place items' caches go into their stores through
        ``write_back`` instead (the copies are recorded, not made: see :class:`CacheWriteBack`). Every
        solve's padded bucket is counted in :attr:`GraphedDiTSolve.used`.
        """
        b, n_mels = len(items), self.n_mels
        if mu is not None:
            dev, dtype = mu.device, mu.dtype
        else:
            dev, dtype = self.input_embedding.weight.device, self.encoder_proj.weight.dtype
        ce = [0 if it.state is None else it.state.cache_frames for it in items]
        graph = self.graph
        bb, mmax, cmax, entry = bucket if bucket is not None else self._solve_bucket(items, mlen, n_timesteps, dtype, dev)
        if graph is not None and mu is not None and mu.shape[1] < mmax:
            mu = F.pad(mu, (0, 0, 0, mmax - mu.shape[1]))
        use_graph = entry is not None
        if mu is None and not (use_graph and len(entry) > 2 and entry[2] is not None):
            raise ValueError("DitFlowModel._solve: mu is None but the bucket has no encoder graph")
        if use_graph:
            bufs = entry[1]
        else:  # no graphs, bucket not captured (yet), or no more graphs allowed: eager on fresh buffers
            bufs = self._solve_buffers(bb, mmax, cmax, n_timesteps, dtype, dev)
        mlen_p, ce_p = mlen + [1] * (bb - b), ce + [0] * (bb - b)
        _, dts, mod_blocks, mod_final = self._time_conditioning(n_timesteps, dtype, dev)
        if use_graph:  # the graph reads its own copies (the cache may be rebuilt)
            bufs["dt"].copy_(dts)
            bufs["mod_blocks"].copy_(mod_blocks)
            bufs["mod_final"].copy_(mod_final)
        else:
            bufs.update(dt=dts, mod_blocks=mod_blocks, mod_final=mod_final)

        # inputs: rows (2i, 2i+1) = (conditional, unconditional) of item i; unconditional rows stay zero
        if self.rand_noise.device != dev:
            self.rand_noise = self.rand_noise.to(dev)
        x0, static_in, att, cnn = bufs["x0"], bufs["static_in"], bufs["att"], bufs["cnn_in"]
        if use_graph:
            static_in.zero_()
        noise = self._padded_noise()  # [80, F + 1], frame F zero
        zero_frame = noise.shape[1] - 1
        idx: list[int] = []  # start noise of every row and frame: frames [C_b, C_b + M_b) of the buffer
        for i in range(bb):
            m, c = (mlen[i], ce[i]) if i < b else (0, 0)
            idx += range(c, c + m)
            idx += [zero_frame] * (mmax - m)
        src = [i for i in range(b) if ce[i]]  # items with an estimator cache
        ix = _ints(idx, dev)
        x0.copy_(noise.index_select(1, ix[: bb * mmax]).view(n_mels, bb, mmax).transpose(0, 1))
        cond_rows = static_in[0: 2 * b: 2]  # [B, 240, M] views of the conditional rows
        if mu is not None:  # else the encoder graph writes it
            cond_rows[:, :n_mels].copy_(mu.transpose(1, 2))
        spk = torch.cat([it.spk if it.spk.dtype == dtype and it.spk.device == dev else it.spk.to(device=dev, dtype=dtype)
                         for it in items])  # [B, 80]
        cond_rows[:, n_mels: 2 * n_mels].copy_(spk.unsqueeze(-1).expand(-1, -1, mmax))
        for i, it in enumerate(items):  # prompt mel (set-ups and offline items only)
            if it.cond is not None:
                f = min(int(it.cond.shape[0]), mlen[i])
                cond_rows[i, 2 * n_mels:, :f] = _to_device(it.cond[:f], dev).to(dtype).transpose(0, 1)

        def steps(t: Tensor) -> Tensor:  # a state's caches for this solve's steps and dtype
            t = t if t.shape[0] == n_timesteps else t[:n_timesteps]
            return t if t.dtype == dtype else t.to(dtype)

        pairs = att.unflatten(2, (bb, 2))  # [S, depth, B, 2, h, M + C, 2hd]: item i's (cond, uncond) rows
        # every cache at frames [M, M + C_b) of its item's rows: one copy per item, of runs of C_b x 2hd
        # contiguous elements (an indexed copy of all items at once moves the same bytes element by
        # element, ~6x slower on an H100: 17 ms of a 32-stream batch's 110 ms)
        for i in src:
            copy_wide_(pairs.select(2, i).narrow(4, mmax, ce[i]), steps(items[i].state.est_att))
        if any(it.state is not None for it in items):
            zero = None
            parts = []
            for it in items:
                if it.state is not None:
                    parts.append(it.state.est_cnn)
                else:
                    if zero is None:
                        ref = next(i.state.est_cnn for i in items if i.state is not None)
                        zero = ref.new_zeros(ref.shape)
                    parts.append(zero)
            cnn[:, :, : 2 * b].copy_(steps(_cat(parts, 2)))
        elif use_graph:
            cnn[:, :, : 2 * b].zero_()
        if use_graph and bb > b:
            cnn[:, :, 2 * b:].zero_()

        uniform = not use_graph and graph is None and len(set(ce)) == 1 and len(set(mlen)) == 1
        if not uniform:
            row_len = _ints(mlen_p, dev).repeat_interleave(2)
            j = torch.arange(mmax + cmax, device=dev).view(1, -1)
            rc = _ints(ce_p, dev).repeat_interleave(2).view(-1, 1)
            mask = ((j < row_len.view(-1, 1)) | ((j >= mmax) & (j < mmax + rc))).view(2 * bb, 1, 1, -1)
            if use_graph:
                bufs["mask"].copy_(mask)
                bufs["new_len"].copy_(row_len)
            else:
                bufs["mask"], bufs["new_len"] = mask, row_len

        if use_graph:
            if mu is None:
                entry[2].replay()  # the encoder: mu into static_in, new encoder caches into its buffers
                graph.encoder_replays += 1
            entry[0].replay()
            graph.replays += 1
        else:
            self._euler(bufs, n_timesteps)

        # new estimator caches of the kept items, each in a storage of its own (a concatenation of the
        # item's frame runs: copies of contiguous runs, not an element-wise gather). Not views of one
        # batch tensor: such a storage lives until the last of its items is replaced, so states of
        # streams batched in changing groups pinned up to ~2x their size (docs/perf.md "Session 26")
        cnn_out = bufs["cnn_out"]  # (``att``, so ``pairs``, was updated in place)
        per_item: list[tuple | None] = [None] * b
        written: set[int] = set()  # stores this batch writes (a store shared by two items is written once)
        for i in range(b):
            if keep_state is not None and not keep_state[i]:
                continue
            it = items[i]
            p = it.prompt_frames if it.state is None else it.state.prompt_frames
            rows = pairs.select(2, i)
            runs = _cache_runs(mlen[i], mmax, ce[i], p, trim_keep)
            cnn_i = _own(cnn_out.narrow(2, 2 * i, 2))
            if not it.in_place or write_back is None:
                est = cat_wide([rows.narrow(4, a, e - a) for a, e in runs], 4)  # [S, depth, 2, h, n, 2hd]
                per_item[i] = (est, cnn_i, None, 0)
                continue
            n = sum(e - a for a, e in runs)
            store = None if it.state is None else it.state.est_store
            if (store is None or id(store) in written or store.capacity < n or store.tensor.dtype != att.dtype
                    or store.tensor.shape[0] != n_timesteps or store.tensor.device != att.device):
                cap = n if trim_keep is None else max(n, p + trim_keep)
                store = EstimatorStore(att.new_empty((*rows.shape[:4], cap, rows.shape[5])))
                gen = 1
            else:
                gen = store.generation + 1
            written.add(id(store))
            at, copies = 0, []
            for a, e in runs:
                copies.append((store.tensor.narrow(4, at, e - a), rows.narrow(4, a, e - a)))
                at += e - a
            write_back._add(store, gen, copies)
            per_item[i] = (store.tensor.narrow(4, 0, n), cnn_i, store, gen)
        x_out = bufs["x_out"][:b]
        return x_out.clone() if use_graph else x_out, per_item

    def _encode_solve(self, items: Sequence[DitItem], n_timesteps: int, trim_keep: int | None,
                      keep_state: Sequence[bool] | None, write_back: CacheWriteBack | None = None):
        """Encoder and solve of a batch: ``(mel [B, 80, Mmax], mel frames per item, new encoder caches,
        new estimator caches)`` (see :meth:`_encode`, :meth:`_solve`).

        With :attr:`graph` set and its encoder graphs on (:attr:`GraphedDiTSolve.encoder`), when the
        batch's solve bucket is published with an encoder graph and the batch fits it (always, for
        states made by this model): the encoder's inputs go into the bucket's static tensors
        (:meth:`_encoder_inputs`), the encoder graph and the solve graph replay back to back, and
        the new encoder caches are gathered from the static tensors (fresh tensors). A batch that fits
        its bucket whose graphs are not published (yet) runs the same padded encoder eagerly on
        fresh tensors (the graphs' numerics), then the solve (eagerly or its graph). Otherwise the
        eager :meth:`_encode`, then :meth:`_solve`."""
        graph = self.graph
        if graph is None or not graph.encoder:
            mu, mlen, enc_caches = self._encode(items, trim_keep, keep_state, check_device_tokens=True)
            mel, est_caches = self._solve(items, mu, mlen, n_timesteps, trim_keep, keep_state, None, write_back)
            return mel, mlen, enc_caches, est_caches
        lists = self._token_lists(items, True)
        host, other, lens = lists
        tlen = self._encoder_frames(items, lens)
        up = self.up_rate
        mlen = [up * t for t in tlen]
        dev, dtype = self.input_embedding.weight.device, self.encoder_proj.weight.dtype
        bucket = self._solve_bucket(items, mlen, n_timesteps, dtype, dev)
        entry = bucket[3]
        c1 = [0 if it.state is None else int(it.state.enc_att1.shape[3]) for it in items]
        if entry is not None and len(entry) > 2 and entry[2] is not None and self._encoder_fits(entry[1], lens, c1):
            bufs = entry[1]
            self._encoder_inputs(items, bufs, host, other, lens, tlen, c1)
            mel, est_caches = self._solve(items, None, mlen, n_timesteps, trim_keep, keep_state, bucket, write_back)
            c1b = self._encoder_dims(bufs)[3]
            # (each item's caches are copied out of the static tensors: the next replay rewrites them)
            enc_caches = self._enc_caches(items, bufs["enc_kv1"], bufs["enc_kv2"], bufs["enc_new_la"],
                                          bufs["enc_new_up"], c1, tlen, c1b, up * c1b, trim_keep, keep_state)
            return mel, mlen, enc_caches, est_caches
        bb, mmax, cmax = bucket[:3]
        tb, c1b = self.encoder_bucket(mmax, cmax)
        if max(tlen) <= tb and max(c1) <= c1b:
            mu, enc_caches = self._encode_padded_run(items, lists, tlen, c1, bb, tb, c1b, trim_keep, keep_state)
            mu = mu[: len(items), :mmax]
        else:  # a state whose caches do not follow the rule (not made by this model): as without graphs
            mu, mlen, enc_caches = self._encode(items, trim_keep, keep_state, token_lists=lists)
        mel, est_caches = self._solve(items, mu, mlen, n_timesteps, trim_keep, keep_state, bucket, write_back)
        return mel, mlen, enc_caches, est_caches

    # ------------------------------------------------------------------ public API

    @torch.inference_mode()
    def forward_items(self, items: Sequence[DitItem], n_timesteps: int | None = None, trim_keep: int | None = None,
                      final_states: bool = True, write_back: CacheWriteBack | None = None) -> list[DitItemResult]:
        """Run offline items, set-ups and chunks of several streams in one padded pass.

        Each item's result holds its mel ``[1, 80, M]`` (float32; ``M = 2 * T`` with ``T`` the
        encoder frames: token count, minus the look-ahead for non-final items) and the new state:
        untrimmed, or, with ``trim_keep``, already trimmed as :func:`trim_state` trims (so
        ``trim_state(state, trim_keep)`` returns it unchanged). ``final_states=False``: items with
        ``last`` set get ``state=None`` (a finished stream's caches are not gathered at all).
        Items are independent; results equal one-item calls.

        In-place items (:attr:`DitItem.in_place`) write their new estimator caches into their streams'
        :class:`EstimatorStore` s: at the end of this call, or, with ``write_back`` given, when the caller
        commits it (:class:`CacheWriteBack`: the caller's last steps may still fail and the batch be
        re-run from the old states). Raises RuntimeError when a previous batch's ``write_back`` is
        still pending (its copies read the buffers this batch would rewrite), ValueError for stale states.

        Host work: the per-item inputs and outputs are moved with batched operations (one
        concatenation + one index operation per cache kind, index lists built on the host as
        Python ints and moved in one copy); each new state's tensors are copied out of the batch's
        buffers into storages of their own (one copy per item and cache kind), which nothing writes
        afterwards.
        With :attr:`graph` set, the encoder and the solve run as the batch's bucket's CUDA graphs when
        published (:meth:`_encode_solve`).
        """
        if not items:
            return []
        pending = self._write_back
        if pending is not None and pending.pending:
            raise RuntimeError("DiT flow: the previous batch's cache write-back was neither committed nor "
                               "discarded (CacheWriteBack.commit / discard)")
        n_timesteps = n_timesteps or self.cfg.n_timesteps
        keep = None if final_states else [not it.last for it in items]
        wb = write_back if write_back is not None else CacheWriteBack()
        self._write_back = wb
        try:
            mel, mlen, enc_caches, est_caches = self._encode_solve(items, n_timesteps, trim_keep, keep, wb)
        except BaseException:
            wb.discard()
            raise
        if write_back is None:
            wb.commit()
        if mel.dtype != torch.float32:
            mel = mel.float()
        out = []
        for i, (it, m) in enumerate(zip(items, mel.split(1))):
            st = None
            if est_caches[i] is not None:
                a1, a2, la, up = enc_caches[i]
                ea, ec, store, gen = est_caches[i]
                p = it.prompt_frames if it.state is None else it.state.prompt_frames
                st = DitStreamState(spk=it.spk, prompt_frames=p, enc_att1=a1, enc_att2=a2, enc_lookahead=la,
                                    enc_up=up, est_att=ea, est_cnn=ec, est_store=store, est_generation=gen)
            out.append(DitItemResult(mel=m[:, :, : mlen[i]] if mlen[i] < m.shape[2] else m, state=st))
        return out

    def prompt_item(self, prompt_tokens: Tensor, prompt_mel: Tensor, embedding: Tensor, extra: Tensor,
                    last: bool) -> DitItem:
        """An item of :meth:`forward_items` starting a stream: ``prompt_tokens`` ``[P_tok]`` followed by
        ``extra`` tokens, ``prompt_mel`` ``[F, 80]`` as ``cond``, raw ``embedding`` ``[192]``. With
        ``last=True`` and ``extra`` the target tokens it is an offline utterance (its mel's first F
        frames are the prompt's); :meth:`setup_item` builds set-ups. The item's tokens stay on the host
        when both token tensors are host tensors (:meth:`forward_items` reads host tokens as Python ints;
        the range check of a device tensor synchronises with the device, which held the engine's
        scheduler thread behind the previous solve for ~40 % of its busy time with offline utterances
        on an H100, docs/perf.md "Session 27"). Raises ValueError on bad shapes or tokens out of range."""
        pt, ex = prompt_tokens.reshape(-1), extra.reshape(-1)
        if pt.device.type == "cpu" and ex.device.type == "cpu":
            tokens = self._check_host_tokens(torch.cat([pt.to(torch.long), ex.to(torch.long)]))
        else:
            tokens = torch.cat([self._check_tokens(pt), self._check_tokens(ex)])
        if prompt_mel.dim() == 3:
            if prompt_mel.shape[0] != 1:
                raise ValueError(f"prompt_mel must be [F, {self.n_mels}] or [1, F, {self.n_mels}]")
            prompt_mel = prompt_mel[0]
        if prompt_mel.dim() != 2 or prompt_mel.shape[1] != self.n_mels:
            raise ValueError(f"prompt_mel must be [F, {self.n_mels}], got {tuple(prompt_mel.shape)}")
        spk = self.project_speaker(embedding.reshape(1, -1))
        return DitItem(tokens=tokens, spk=spk, last=last, cond=prompt_mel, prompt_frames=int(prompt_mel.shape[0]))

    def setup_item(self, prompt_tokens: Tensor, prompt_mel: Tensor, embedding: Tensor,
                   silence_token: int = SILENCE_TOKEN) -> DitItem:
        """The set-up item of a stream: prompt tokens ``[P_tok]`` + ``pre_lookahead_len`` x ``silence_token``,
        ``prompt_mel`` ``[F, 80]`` with ``F = up_rate * P_tok`` (upstream asserts it), raw ``embedding``
        ``[192]``. Raises ValueError if the prompt mel length does not match."""
        n = int(prompt_tokens.numel())
        f = int(prompt_mel.shape[-2])
        if n < 1 or f != n * self.up_rate:
            raise ValueError(f"prompt of {n} tokens needs {n * self.up_rate} mel frames, got {f}")
        extra = torch.full((self.pre_lookahead_len,), silence_token, dtype=torch.long)
        return self.prompt_item(prompt_tokens, prompt_mel, embedding, extra, last=False)

    @torch.inference_mode()
    def setup_batch(self, prompts: Sequence[tuple[Tensor, Tensor, Tensor]], n_timesteps: int | None = None,
                    silence_token: int = SILENCE_TOKEN) -> list[DitStreamState]:
        """:meth:`setup` for several streams ``(prompt_tokens, prompt_mel, embedding)`` in one pass."""
        items = [self.setup_item(pt, pm, emb, silence_token) for pt, pm, emb in prompts]
        return [r.state for r in self.forward_items(items, n_timesteps)]

    def setup(self, prompt_tokens: Tensor, prompt_mel: Tensor, embedding: Tensor, n_timesteps: int | None = None,
              silence_token: int = SILENCE_TOKEN) -> DitStreamState:
        """Start a stream (upstream ``set_stream_cache`` -> ``flow.setup_cache``).

        ``prompt_tokens`` ``[P_tok]`` (or ``[1, P_tok]``) int, ``prompt_mel`` ``[2 * P_tok, 80]`` (or
        ``[1, ., 80]``) natural-log mel, ``embedding`` ``[192]`` raw CAM++ embedding. The prompt is
        followed by ``pre_lookahead_len`` silence tokens (4218) as its look-ahead. Returns the caches.
        """
        return self.setup_batch([(prompt_tokens, prompt_mel, embedding)], n_timesteps, silence_token)[0]

    @torch.inference_mode()
    def chunk_batch(self, states: Sequence[DitStreamState], tokens: Sequence[Tensor], last: Sequence[bool],
                    n_timesteps: int | None = None, trim_keep: int | None = TRIM_KEEP) -> list[tuple[Tensor, DitStreamState]]:
        """:meth:`chunk` for several streams in one padded pass: ``[(mel [1, 80, M_b], new_state)]``."""
        if not (len(states) == len(tokens) == len(last)):
            raise ValueError("states, tokens and last must have the same length")
        items = [DitItem(tokens=tk.reshape(-1), spk=st.spk, last=bool(lf), state=st)
                 for st, tk, lf in zip(states, tokens, last)]
        res = self.forward_items(items, n_timesteps, trim_keep)  # states trimmed there (as trim_state trims)
        return [(r.mel, r.state) for r in res]

    def chunk(self, state: DitStreamState, tokens: Tensor, last: bool, n_timesteps: int | None = None,
              trim_keep: int | None = TRIM_KEEP) -> tuple[Tensor, DitStreamState]:
        """One streaming step (upstream ``inference_chunk`` + the driver's cache trimming).

        ``tokens`` ``[n]`` int: new tokens; a non-final chunk ends with ``pre_lookahead_len`` look-ahead
        tokens that the next chunk sends again. Returns ``(mel [1, 80, 2*(n - la)] or [1, 80, 2*n]
        when last, float32, new state)``; ``state`` is unchanged. ``trim_keep=None`` disables trimming.
        """
        return self.chunk_batch([state], [tokens], [last], n_timesteps, trim_keep)[0]

    @torch.inference_mode()
    def inference_batch(self, requests: Sequence[tuple[Tensor, Tensor, Tensor, Tensor]],
                        n_timesteps: int | None = None) -> list[Tensor]:
        """Offline mel for several requests ``(tokens [N], prompt_tokens [P_tok], prompt_mel [F, 80],
        embedding [192])`` in one pass; returns ``[1, 80, 2*(P_tok + N) - F]`` float32 each (upstream
        ``CausalMaskedDiffWithXvec.inference``: prompt and target encoded together, the prompt mel as
        ``cond``, the first F frames dropped)."""
        items = []
        for tok, pt, pm, emb in requests:
            items.append(self.prompt_item(pt, pm, emb, tok, last=True))
        res = self.forward_items(items, n_timesteps)
        out = []
        for it, r in zip(items, res):
            if r.mel.shape[-1] <= it.prompt_frames:
                raise ValueError(f"prompt mel of {it.prompt_frames} frames is not shorter than the "
                                 f"{r.mel.shape[-1]} frames of prompt + target")
            out.append(r.mel[:, :, it.prompt_frames:])
        return out

    def inference(self, tokens: Tensor, prompt_tokens: Tensor, prompt_mel: Tensor, embedding: Tensor,
                  n_timesteps: int | None = None) -> Tensor:
        """Offline mel ``[1, 80, 2*(P_tok + N) - F]`` (float32) for ``tokens`` ``[N]`` after the prompt
        (see :meth:`inference_batch`)."""
        return self.inference_batch([(tokens.reshape(-1), prompt_tokens.reshape(-1), prompt_mel, embedding)],
                                    n_timesteps)[0]


# ----------------------------------------------------------------------------------------------
# CUDA graphs
# ----------------------------------------------------------------------------------------------


def stream_solve_shapes(prompt_tokens: int, hops: Sequence[int], lookahead: int, up_rate: int,
                        trim_keep: int = TRIM_KEEP) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """The unpadded ``(frames, cache frames)`` of every solve :meth:`DitFlowModel._solve` runs for one
    stream, as the engine drives it (:class:`~cosyserve.engine.token2wav_dit.DitToken2WavBackend`).

    Args:
        prompt_tokens: ``P``, the voice's flow prompt tokens (its prompt mel has ``up_rate * P`` frames).
        hops: the stream's non-final hops in order (tokens; the chunk policy's schedule, e.g.
            ``ChunkPolicy.hops``); the stream may end after any of them. Each non-final chunk sends
            ``hop + lookahead`` tokens, the final one the ``r`` tokens left (``lookahead <= r <
            next hop + lookahead``: with more, a non-final chunk is made first).
        lookahead: the flow's ``pre_lookahead_len`` (the chunk policy must send as many).
        up_rate: mel frames per token.
        trim_keep: the driver's trim (:func:`trim_state`): caches longer than ``P_frames + trim_keep``
            keep ``P_frames + trim_keep`` frames.

    Returns ``(set-ups, chunks)``: the set-up solve ``{(up_rate * P, 0)}`` (prompt + look-ahead
    silence: only the prompt's frames are solved) and every non-final and final chunk's
    ``(up_rate * new tokens, cache)``, the cache starting at the set-up's ``up_rate * P`` frames and
    growing by each chunk up to ``up_rate * P + trim_keep``. A stream whose first chunk never
    became ready runs offline (prompt + all tokens, no cache): not covered. Pure arithmetic; raises
    ValueError for a non-positive ``prompt_tokens`` / ``up_rate`` or a negative ``lookahead`` /
    ``trim_keep``.
    """
    if prompt_tokens < 1 or up_rate < 1 or lookahead < 0 or trim_keep < 0:
        raise ValueError("stream_solve_shapes: prompt_tokens and up_rate must be positive, lookahead and "
                         "trim_keep non-negative")
    p = up_rate * prompt_tokens
    cap = p + trim_keep
    chunks: set[tuple[int, int]] = set()
    seen: set[tuple[int, int, int]] = set()
    c = p  # the set-up's cache: the prompt's frames
    for k, hop in enumerate(hops):
        nxt = hops[k + 1] if k + 1 < len(hops) else hop
        before, c = c, min(c + up_rate * hop, cap)
        if (hop, nxt, before) in seen:  # steady state (the cache at its cap): nothing new
            continue
        seen.add((hop, nxt, before))
        chunks.add((up_rate * hop, before))
        for r in range(max(1, lookahead), nxt + lookahead):  # a final chunk after this one
            chunks.add((up_rate * r, c))
    return {(p, 0)}, chunks


class GraphedDiTSolve(_GraphStage):
    """CUDA graphs of the whole DiT Euler/CFG solve (``n_timesteps`` estimator calls with the CFG
    combination and the Euler updates: thousands of small kernels), one graph per bucket
    ``(rows, padded frames, padded cache frames)`` of the flow's steps and dtype: a
    :class:`~cosyserve.models.graphs._GraphStage` (capture, publication, eager fallback,
    ``capture_on_use``, :meth:`warmup`, the engine's ``BackgroundCapturer``).

    :meth:`DitFlowModel._solve` pads a batch's items to :meth:`rows_bucket`, its chunk frames to a
    multiple of ``frames_bucket`` and its cache frames to a multiple of ``cache_bucket`` (padded
    keys are masked, padded frames and rows ignored: results equal eager up to float summation
    order), so a stream in steady state (its cache trimmed to ``P + 100`` frames) reuses one graph
    per chunk size. :meth:`keys` are the buckets :meth:`plan` was given (the engine plans those its
    streams reach: :func:`stream_solve_shapes`); a bucket not captured runs eagerly with the same
    padding (fresh buffers), unless ``capture_on_use`` captures it then (``--lazy-graphs``, or a
    stage no capturer owns); past ``max_graphs`` graphs, everything else runs eagerly.

    Buffers: every input/output of a graph (the per-step key/value buffer ``[S, depth, 2B, H,
    M + C, 2hd]``, the conv caches, noise, conditioning, mask, lengths, time conditioning, mel) is
    a view of a storage shared by all graphs (graphs replay one at a time, and a solve rewrites
    every input before its replay), grown 2x when a larger bucket appears (graphs captured on the
    old storage keep it: nothing is recaptured; the storages of all generations together stay below
    twice the largest; the largest-first capture order sizes them once), so hundreds of buckets cost
    the largest bucket's buffers once. All graphs share one memory pool. Not thread-safe for solves: one solve at a time (captures may run in
    another thread: they never write what a replay reads).

    Encoder (:attr:`encoder`, default on): each bucket's entry ``(solve graph, buffers, encoder
    graph)`` also holds a graph of the streaming encoder's padded static form
    (:meth:`DitFlowModel._encode_static` for :meth:`DitFlowModel.encoder_bucket` of the bucket's
    frames and cache: the solve's bucket implies it, nothing else is planned), recorded in the same
    pool over static tensors shared the same way (:meth:`DitFlowModel._encoder_shapes`); it writes
    ``mu`` into the solve's inputs and is replayed just before the solve graph
    (:meth:`DitFlowModel._encode_solve`), so a batch's encoder costs one launch instead of ~1,100
    eager operators. Callers that bring their own ``mu`` replay the solve graph alone.
    """

    name = "DiT solve"
    demand_first = False  # the largest-first capture order sizes the shared storages once

    def __init__(self, frames_bucket: int = 25, cache_bucket: int = 64, max_graphs: int = 512,
                 flow: "DitFlowModel | None" = None, encoder: bool = True):
        if frames_bucket < 1 or cache_bucket < 1 or max_graphs < 1:
            raise ValueError("graph buckets and max_graphs must be positive")
        self.fb, self.cb, self.max_graphs = frames_bucket, cache_bucket, max_graphs
        self.flow = flow
        #: each bucket also records the padded streaming encoder (:meth:`DitFlowModel._encode_static`)
        #: as a second graph replayed just before the solve's; set before the first capture
        self.encoder = encoder
        self.encoder_replays = 0
        self._enc_warmed: set[tuple[int, int, int]] = set()  # buckets whose encoder ran eagerly (warm-ups)
        p = next(flow.parameters(), None) if flow is not None else None
        self._init_stage(p.device if p is not None else "cpu")
        self._flat: dict[str, Tensor] = {}
        self._plan: list[tuple[int, int, int]] = []
        self._plan_replaced = False  # replace_default_plan() was done
        self._warm_classes: set[tuple[bool, bool]] = set()  # warm-up classes captured once (capture)
        self.replays = 0
        #: the engine's scheduler forms chunk batches of at most this many items (None: no bound): the
        #: most rows whose buffers fit the memory share the plan allows (EngineCore._plan_dit_graphs)
        self.max_rows: int | None = None
        #: solves per bucket ``(rows, frames, cache)`` seen by :meth:`DitFlowModel._solve` (graphed or eager)
        self.used: Counter = Counter()
        #: solves without cache (set-ups, offline utterances: prompt + every target token in one pass)
        #: pad to the coarse :meth:`solve_frames_bucket` once :meth:`plan` planned offline utterances
        self.coarse_uncached = False
        #: the most offline utterances one planned graph solves (None: not planned); the engine's DiT
        #: backend runs larger groups of them in several solves
        self.offline_rows: int | None = None

    # ------------------------------------------------------------------ buckets
    def frames_bucket(self, m: int) -> int:
        return -(-m // self.fb) * self.fb

    def solve_frames_bucket(self, m: int, c: int) -> int:
        """The padded frames of a solve of ``m`` frames and ``c`` cache frames: :meth:`frames_bucket`,
        except for solves without cache once offline utterances are planned
        (:attr:`coarse_uncached`): a multiple of 128 frames up to 1024, of 256 beyond (utterance
        lengths vary widely: a dozen graphs per row count cover 2 .. 40 s; the padding is masked like
        any other)."""
        if c == 0 and self.coarse_uncached:
            step = 128 if m <= 1024 else 256
            return -(-m // step) * step
        return self.frames_bucket(m)

    def cache_bucket(self, c: int) -> int:
        return -(-c // self.cb) * self.cb if c > 0 else 0

    @staticmethod
    def rows_bucket(b: int) -> int:
        """Items padded to 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (at most a third of a batch is padding)."""
        p = 1
        while True:
            for c in (p, 3 * p // 2):
                if c >= b and c > 0:
                    return c
            p *= 2

    @classmethod
    def rows_buckets(cls, max_rows: int) -> list[int]:
        """Every :meth:`rows_bucket` a batch of 1 .. ``max_rows`` items uses, ascending."""
        return sorted({cls.rows_bucket(b) for b in range(1, max(1, max_rows) + 1)})

    @property
    def n_timesteps(self) -> int:
        """The Euler steps the graphs solve (the flow's configured count; other counts run eagerly)."""
        return self.flow.cfg.n_timesteps

    @property
    def dtype(self) -> torch.dtype:
        """The estimator's dtype (graphs are captured in it; a solve in another dtype runs eagerly)."""
        return self.flow.decoder.estimator.in_proj.weight.dtype

    @property
    def captures(self) -> int:
        """Graphs captured so far (:attr:`n_graphs`)."""
        return self.n_graphs

    def plan(self, setups: set[tuple[int, int]], chunks: set[tuple[int, int]], max_rows: int,
             setup_rows: int = 4, fits=None, up_rate: int = 2, max_bytes: int | None = None,
             offline: set[int] = frozenset(), offline_rows: int = 8) -> int:
        """Add to :meth:`keys` the buckets that streams with these unpadded solve shapes use
        (:func:`stream_solve_shapes` of each prompt length): set-up batches of up to ``setup_rows``
        prompts at any of the set-ups' frame buckets (no cache), and chunk batches of up to
        ``max_rows`` items at every (frames bucket, cache bucket) pair of the chunks (a batch pads to
        its largest frames and largest cache, which may come from different streams). ``offline``:
        frame counts of offline utterances (no cache) to plan too, in batches of up to
        ``offline_rows``; then every solve without cache, set-ups included, pads to the coarse
        :meth:`solve_frames_bucket` (eagerly, a 10-second utterance's solve costs ~230 ms of host
        time on an H100, 36 ms as a graph, docs/perf.md "Session 26").

        ``fits(rows, tokens) -> bool``: the scheduler's batch budget (rows x the longest job's
        cost in flow tokens, its new tokens plus its cache's tokens at ``up_rate`` frames per
        token; a lone job always runs). A bucket is kept only if the fewest rows that use it, each
        at least as long as its frames and cache imply, fit: larger ones are never formed (and
        their buffers could not be allocated). ``max_bytes``: buckets whose buffers
        (:meth:`buffer_bytes`, held by the shared storages once captured) exceed it are left out
        (they run eagerly, allocating only when such a batch forms). Past ``max_graphs`` buckets the
        largest are left out (logged). Returns the number of keys."""
        fr = sorted({self.frames_bucket(f) for f, _ in chunks})
        ca = sorted({self.cache_bucket(c) for _, c in chunks})
        keys = {(r, f, c) for r in self.rows_buckets(max_rows) for f in fr for c in ca}
        if offline:
            self.coarse_uncached = True
            self.offline_rows = self.rows_bucket(min(offline_rows, max_rows))
            keys |= {(r, self.solve_frames_bucket(f, 0), 0) for r in self.rows_buckets(min(offline_rows, max_rows))
                     for f in offline}
        keys |= {(r, self.solve_frames_bucket(f, c), self.cache_bucket(c))
                 for r in self.rows_buckets(min(setup_rows, max_rows)) for f, c in setups}
        if fits is not None:
            rows = self.rows_buckets(max_rows)
            fewest = {r: (rows[i - 1] + 1 if i else 1) for i, r in enumerate(rows)}

            def reachable(key) -> bool:
                r, f, c = key
                new = -(-(f - self.fb + 1) // up_rate)  # the longest row's new tokens at least
                cached = -(-(c - self.cb + 1) // up_rate) + 1 if c > 0 else 0  # the row with the longest cache
                return fewest[r] == 1 or fits(fewest[r], max(1, new, cached))

            keys = {k for k in keys if reachable(k)}
        if max_bytes is not None:
            keys = {k for k in keys if self.buffer_bytes(k) <= max_bytes}
        keys |= set(self._plan)
        ordered = sorted(keys, key=lambda k: (self._size(k), k))
        if len(ordered) > self.max_graphs:
            log.warning("DiT solve: %d graph buckets planned, %d allowed (max_graphs): the %d largest run eagerly",
                        len(ordered), self.max_graphs, len(ordered) - self.max_graphs)
            ordered = ordered[: self.max_graphs]
        self._plan = ordered
        return len(ordered)

    def replace_default_plan(self) -> bool:
        """Forget the planned buckets once, the first time the prompts to serve are known (the plan
        so far was a default), and only while nothing is captured. Returns whether it did."""
        if self._plan_replaced or self._graphs:
            return False
        self._plan, self._plan_replaced = [], True
        return True

    def keys(self) -> list[tuple[int, int, int]]:
        """The planned buckets ``(rows, frames, cache)`` (:meth:`plan`), smallest first."""
        return list(self._plan)

    def _size(self, key) -> float:
        """Size of a bucket: rows x attended frames, what its key/value buffer (by far the largest of
        its buffers) holds; the capture order starts with the largest, which sizes the shared
        storages once."""
        r, f, c = key
        return r * (f + c + 1)

    def order(self, keys: list) -> list:
        """The largest bucket first while none is captured (it sizes the shared storages and the
        pool once), then smallest first (what a lone stream needs)."""
        keys = sorted(keys, key=lambda k: (self._size(k), k))
        if keys and not self._graphs:
            keys.insert(0, keys.pop())
        return keys

    # ------------------------------------------------------------------ capture
    def _retarget(self, dev) -> bool:
        """Follow the flow to ``dev`` while nothing is captured; False if graphs exist elsewhere."""
        dev = torch.device(dev)
        if dev == self.device:
            return True
        if self._graphs:
            return False
        on_use = self.capture_on_use
        self._init_stage(dev)  # a new pool and capture stream on that device
        self.capture_on_use = on_use
        self._flat = {}
        self._enc_warmed = set()
        return True

    def _shared(self, name: str, shape: tuple, dtype: torch.dtype, dev) -> Tensor:
        numel = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.numel() < numel or flat.dtype != dtype or flat.device != torch.device(dev):
            # grown 2x: graphs captured on the old storage keep it (their buffers are views of it)
            # and stay valid, so a larger bucket never forces recaptures (that thrashed under load)
            grown = numel if flat is None else max(numel, 2 * flat.numel())
            flat = self._flat[name] = torch.zeros(grown, dtype=dtype, device=dev)
        return flat[:numel].view(shape)

    def _shapes(self, b: int, mmax: int, cmax: int) -> dict[str, tuple[tuple, torch.dtype]]:
        """``name -> (shape, dtype)`` of every tensor a bucket's graphs read or write
        (:meth:`DitFlowModel._solve_shapes` at the flow's steps and dtype; with :attr:`encoder` also
        :meth:`DitFlowModel._encoder_shapes` of :meth:`DitFlowModel.encoder_bucket`)."""
        shapes = self.flow._solve_shapes(b, mmax, cmax, self.n_timesteps, self.dtype)
        if self.encoder:
            shapes.update(self.flow._encoder_shapes(b, *self.flow.encoder_bucket(mmax, cmax), self.dtype))
        return shapes

    def buffer_bytes(self, key: tuple[int, int, int]) -> int:
        """Bytes of a bucket's buffers (what the shared storages hold when ``key`` is the largest)."""
        return sum(math.prod(shape) * torch.empty(0, dtype=dt).element_size()
                   for shape, dt in self._shapes(*key).values())

    @staticmethod
    def _warm_class(key) -> tuple[bool, bool]:
        """Buckets that share lazily initialised state: one row or more (fused kernels specialise
        size 1), with a cache or without (a different attention length set-up)."""
        r, _, c = key
        return r == 1, c > 0

    def capture(self, key, background: bool = False, level: int = logging.DEBUG):
        """:meth:`_GraphStage.capture`, but the eager warm-up (a whole 10-step solve: most of a
        capture's time at large buckets) runs only for the first bucket of its :meth:`_warm_class`;
        the others' lazy state (fused kernels with symbolic shapes, library handles, workspaces)
        exists already. A capture without its warm-up that fails is retried once with it."""
        cls = self._warm_class(key)
        skipped = key not in self._warmed and cls in self._warm_classes
        if skipped:
            self._warmed.add(key)
        try:
            entry = super().capture(key, background, level)
        except Exception:
            if not skipped:
                raise
            self._warmed.discard(key)
            log.info("DiT solve graph %s: capture without warm-up failed, retrying with it", key)
            entry = super().capture(key, background, level)
        self._warm_classes.add(cls)
        return entry

    @torch.inference_mode()
    def _warm_up(self, b: int, mmax: int, cmax: int) -> None:
        """One eager solve (with :attr:`encoder`, encoder first) of the bucket's shapes on private,
        fresh tensors (lazy initialisation)."""
        flow, steps, dev = self.flow, self.n_timesteps, self.device
        bufs = {name: torch.zeros(shape, dtype=dt, device=dev) for name, (shape, dt) in self._shapes(b, mmax, cmax).items()}
        bufs["mask"].fill_(True)
        bufs["new_len"].fill_(mmax)
        _, dts, blocks, final = flow._time_conditioning(steps, self.dtype, dev, cache=False)
        bufs.update(dt=dts, mod_blocks=blocks, mod_final=final)
        if self.encoder:
            self._warm_up_encoder(b, mmax, cmax, bufs)
        flow._euler(bufs, steps)

    def _warm_up_encoder(self, b: int, mmax: int, cmax: int, bufs: dict | None = None) -> None:
        """One eager run of the bucket's encoder graph body on private tensors (``bufs``: the solve
        warm-up's, else fresh ones): lazily initialised state (GEMM and attention kernel choices,
        workspaces) may depend on the shapes, and it is cheap next to a solve, so it runs for every
        bucket, also those whose solve warm-up :meth:`capture` skips."""
        flow = self.flow
        if bufs is None:
            bufs = {name: torch.zeros(shape, dtype=dt, device=self.device)
                    for name, (shape, dt) in self._shapes(b, mmax, cmax).items()
                    if name.startswith("enc_") or name == "static_in"}
        flow._encoder_fill(bufs)
        flow._encode_graph_body(bufs)
        self._enc_warmed.add((b, mmax, cmax))

    @torch.inference_mode()
    def _record_entry(self, key, background: bool):
        """Record :meth:`DitFlowModel._euler` over the bucket's buffers, all of them views of the
        storages shared by every graph (nothing written: :meth:`DitFlowModel._solve` rewrites every
        input before a replay), and with :attr:`encoder` first
        :meth:`DitFlowModel._encode_graph_body` (the padded encoder, writing the solve's ``mu``) as
        a graph of its own in the same pool; returns ``(solve graph, buffers, encoder graph or
        None)``. The solve graph alone serves callers that bring ``mu``."""
        from . import graphs as _graphs  # tests substitute graphs._record

        flow, steps, dev = self.flow, self.n_timesteps, self.device
        shapes = self._shapes(*key)
        for name, (shape, dt) in shapes.items():  # grow every shared storage first
            self._shared(name, shape, dt, dev)
        bufs = {name: self._shared(name, shape, dt, dev) for name, (shape, dt) in shapes.items()}
        g_enc = None
        if self.encoder:
            if tuple(key) not in self._enc_warmed:  # the bucket's solve warm-up was skipped (capture)
                self._warm_up_encoder(*key)
            g_enc, _ = _graphs._record(lambda: flow._encode_graph_body(bufs), self.pool, self.stream,
                                       settle_first=not background)
        g, _ = _graphs._record(lambda: flow._euler(bufs, steps), self.pool, self.stream,
                               settle_first=not background and g_enc is None)
        return g, bufs, g_enc

    def lookup(self, key):
        """The published ``(graph, buffers)`` of ``key`` or None (run eagerly); captures it now with
        ``capture_on_use`` while fewer than ``max_graphs`` graphs exist."""
        if key not in self._graphs and len(self._graphs) >= self.max_graphs:
            return None
        return super().lookup(key)

    def solve_entry(self, key: tuple[int, int, int], n_timesteps: int, dtype: torch.dtype, dev):
        """:meth:`lookup` for a solve of ``n_timesteps`` steps in ``dtype`` on ``dev``; None (eager)
        when the graphs cannot serve it (other steps, dtype or device) or ``key`` is not published
        (and not captured on use). Off CUDA only published entries are returned (tests record with a
        stand-in)."""
        if n_timesteps != self.n_timesteps or dtype != self.dtype or not self._retarget(dev):
            return None
        if torch.device(dev).type != "cuda" and key not in self._graphs:
            return None
        entry = self.lookup(key)
        if entry is None or entry[1]["static_in"].dtype != dtype:
            return None
        return entry
