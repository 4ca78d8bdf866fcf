"""The CosyVoice2 / CosyVoice3 speech language model with a slot-based KV cache.

Architecture (upstream ``cosyvoice/llm/llm.py``, classes ``Qwen2LM`` and ``CosyVoice3LM``): a
Qwen2 decoder (``transformers.Qwen2ForCausalLM`` built from ``CosyVoice-BlankEN/config.json``;
its text ``lm_head`` is never used) plus the CosyVoice heads:

* ``llm_embedding``   ``[2, H]`` (CosyVoice2 only): row 0 = sos, row 1 = task id;
* ``speech_embedding`` ``[S+E, H]``: speech tokens ``0..S-1`` and ``E`` extra ids (3 for
  CosyVoice2; 200 for CosyVoice3, whose sos and task id are rows ``S`` and ``S+2`` here);
* ``llm_decoder``     ``Linear(H, S+E)`` (no bias for CosyVoice3): next-speech-token logits.

``S`` is ``speech_token_size`` (6561); every extra id stops decoding (CosyVoice2: ``S`` is
end-of-speech, ``S+2`` the fill token; CosyVoice3: ``S+1`` end-of-speech, ``S+3`` fill). Id
layouts come from :class:`~cosyserve.models.config.LLMConfig`. The input sequence of a request is::

    [sos] + embed_tokens(prompt_text + text) + [task_id] + speech_embedding(prompt_speech_tokens)

and every later step feeds ``speech_embedding[previous token]``.

Decoding runs the transformers Qwen2 layer modules (projections, RMSNorm, MLP, rotary
tables) under cosyserve's own attention loop over a static KV cache with one *slot* per
request (:class:`KVCache`), so that many requests at different positions can share one
decode step (continuous batching) and the step has static shapes (CUDA-graph friendly).
The maths is exactly Qwen2's causal attention with rotary position embeddings; parity
with upstream's ``forward_one_step`` (transformers 4.51 sdpa) is tested on the
reference cases.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import LLMConfig
from .fused import FusedOp
from .sampling import UpstreamSampler, ras_sample_device
from .transfer import to_device


def _qwen2_config(cfg: LLMConfig):
    from transformers import Qwen2Config

    if not cfg.qwen:
        raise ValueError("LLMConfig.qwen (CosyVoice-BlankEN/config.json) is required to build the speech LM")
    # The LM runs in the dtype of the loaded weights; drop the checkpoint's storage-dtype hint.
    fields = {k: v for k, v in cfg.qwen.items() if k not in ("torch_dtype", "dtype")}
    return Qwen2Config(**fields)


class _Qwen2Holder(nn.Module):
    """Mirror of upstream ``Qwen2Encoder``: holds ``model`` (a ``Qwen2ForCausalLM``)."""

    def __init__(self, qwen_config):
        super().__init__()
        from transformers import Qwen2ForCausalLM

        self.model = Qwen2ForCausalLM(qwen_config)


@dataclass
class KVCache:
    """Static per-slot key/value cache for the Qwen2 backbone.

    ``k``/``v``: ``[n_layers, n_slots, n_kv_heads, max_len, head_dim]`` in the LM dtype.
    One slot holds one request's sequence (prompt prefix + generated speech tokens);
    position ``p`` of slot ``s`` lives at ``[:, s, :, p]``. Slots are assigned and freed by
    the caller (engine scheduler); nothing here tracks which are in use.
    """

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, lm: "SpeechLM", n_slots: int, max_len: int, device=None, dtype=None) -> "KVCache":
        qc = lm.qwen_config
        n_kv = qc.num_key_value_heads
        head_dim = getattr(qc, "head_dim", None) or qc.hidden_size // qc.num_attention_heads
        p = lm.llm_decoder.weight
        shape = (qc.num_hidden_layers, n_slots, n_kv, max_len, head_dim)
        device = device or p.device
        dtype = dtype or p.dtype
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    @property
    def n_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@dataclass
class DecodeState:
    """Per-slot device state of decoding with device sampling (one row per KV-cache slot).

    ``last``: int64 ``[n_slots]``, the newest token of each slot's sequence (the next decode
    step's input); ``recent``: int64 ``[n_slots, win]``, its last ``win`` tokens (``-1`` where
    fewer exist: the repetition window of RAS). :meth:`SpeechLM.decode_sample` reads and
    updates it on the device, so the next step can be issued before this step's tokens reach
    the host (the engine's pipelined decoding; vLLM's asynchronous scheduling does the same).
    """

    last: torch.Tensor
    recent: torch.Tensor

    @classmethod
    def allocate(cls, n_slots: int, win: int, device=None) -> "DecodeState":
        return cls(torch.zeros(n_slots, dtype=torch.long, device=device),
                   torch.full((n_slots, max(1, win)), -1, dtype=torch.long, device=device))

    def load(self, slots: list[int], histories: list[list[int]]) -> None:
        """Set the slots' state from host token histories (the tokens generated so far; an empty
        history leaves ``last`` at 0). One host-to-device copy per tensor, ordered on the current
        stream."""
        w = self.recent.shape[1]
        rec = torch.full((len(slots), w), -1, dtype=torch.long)
        last = torch.zeros(len(slots), dtype=torch.long)
        for j, hist in enumerate(histories):
            tail = hist[-w:]
            if tail:
                rec[j, w - len(tail):] = torch.tensor(tail)
                last[j] = tail[-1]
        idx = to_device(torch.tensor(slots, dtype=torch.long), self.last.device)
        self.last[idx] = to_device(last, self.last.device)
        self.recent[idx] = to_device(rec, self.recent.device)

    def push(self, slots: torch.Tensor | slice, tokens: torch.Tensor, active: torch.Tensor | None = None) -> None:
        """Append device ``tokens [B]`` to the state of ``slots`` (device int64 ``[B]``, or a
        ``slice`` of ``B`` consecutive slots), in place and without host synchronisation
        (CUDA-graph safe). With ``active`` (bool ``[B]``) only those rows are appended; the
        others' state is left as it was (the idle rows of a slot-ordered decode step)."""
        recent = self.recent[slots]
        shifted = torch.cat((recent[:, 1:], tokens[:, None]), dim=1)
        if active is not None:
            tokens = torch.where(active, tokens, self.last[slots])
            shifted = torch.where(active[:, None], shifted, recent)
        self.last[slots] = tokens
        self.recent[slots] = shifted

    def restart(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """A new sequence in ``slots`` whose first token is ``tokens`` (device tensors)."""
        self.recent[slots] = -1
        self.push(slots, tokens)


def _rope_eager(qk: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding ``x cos + rotate_half(x) sin`` of ``qk [B, T, H, D]`` with float32 tables
    ``cos``, ``sin_signed`` ``[B, T, 1, D]`` (``rotate_half(x) sin = cat(x2, x1) * cat(-sin1,
    sin2)``), computed in float32 and rounded once to ``qk``'s dtype."""
    half = qk.shape[-1] // 2
    rot = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
    return (qk.float() * cos + rot.float() * sin_signed).to(qk.dtype)


def _silu_mul_eager(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = cat(gate, up)`` on the last dim (Qwen2's MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(gate_up.dtype)


#: one kernel each on CUDA (:mod:`cosyserve.models.fused`): the rotary embedding of queries and
#: keys, and the MLP's gated activation
_rope = FusedOp(_rope_eager, "rope")
_silu_mul = FusedOp(_silu_mul_eager, "silu_mul")


def _rms_eps(norm: nn.Module) -> float:
    """The epsilon of a transformers ``Qwen2RMSNorm`` (attribute name differs across versions)."""
    for name in ("variance_epsilon", "eps"):
        if hasattr(norm, name):
            return float(getattr(norm, name))
    raise AttributeError("RMSNorm without an epsilon attribute")


def _add_linear(h: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``h + linear(x, weight, bias)`` for ``h [B, T, H]`` and ``x2d [B*T, K]``; without a bias
    the residual add is the GEMM's accumulator (one ``addmm`` kernel instead of two)."""
    if bias is not None:
        return h + F.linear(x2d, weight, bias).view(h.shape)
    return torch.addmm(h.reshape(-1, h.shape[-1]), x2d, weight.t()).view(h.shape)


def _alias_cat(mods: list[nn.Module], name: str) -> torch.Tensor | None:
    """Concatenate parameter ``name`` of ``mods`` along dim 0 into one tensor and make each
    module's parameter a view of its rows (no extra memory; in-place loads still reach the
    fused tensor). Returns the fused tensor, or None if the parameter is missing anywhere."""
    parts = [getattr(m, name) for m in mods]
    if any(p is None for p in parts):
        if not all(p is None for p in parts):
            raise ValueError(f"fusing {name}: present on some projections only")
        return None
    fused = torch.cat([p.detach() for p in parts], dim=0)
    row = 0
    for m, p in zip(mods, parts):
        n = p.shape[0]
        setattr(m, name, nn.Parameter(fused[row:row + n], requires_grad=p.requires_grad))
        row += n
    return fused


@dataclass
class _FusedLayer:
    """One Qwen2 decoder layer's weights as the fused decode path reads them: q/k/v and
    gate/up projections concatenated (``qkv_w [(n_heads + 2 n_kv) D, H]``, ``gate_up_w
    [2 I, H]``), whose rows the original ``nn.Linear`` parameters are views of."""

    ln1_w: torch.Tensor
    ln1_eps: float
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    ln2_w: torch.Tensor
    ln2_eps: float
    gate_up_w: torch.Tensor
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None
    act: nn.Module
    #: the data pointers of every parameter of the layer it was built from: rebuilt when any changes
    key: tuple

    @staticmethod
    def key_of(layer: nn.Module) -> tuple:
        return tuple(p.data_ptr() for p in layer.parameters())

    @classmethod
    def build(cls, layer: nn.Module) -> "_FusedLayer":
        a, m = layer.self_attn, layer.mlp
        qkv = [a.q_proj, a.k_proj, a.v_proj]
        gate_up = [m.gate_proj, m.up_proj]
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, even if called in inference mode
            qkv_w, qkv_b = _alias_cat(qkv, "weight"), _alias_cat(qkv, "bias")
            gate_up_w, gate_up_b = _alias_cat(gate_up, "weight"), _alias_cat(gate_up, "bias")
        return cls(layer.input_layernorm.weight, _rms_eps(layer.input_layernorm), qkv_w, qkv_b,
                   a.o_proj.weight, a.o_proj.bias, layer.post_attention_layernorm.weight,
                   _rms_eps(layer.post_attention_layernorm), gate_up_w, gate_up_b,
                   m.down_proj.weight, m.down_proj.bias, m.act_fn, cls.key_of(layer))


class SpeechLM(nn.Module):
    """Speech LM (upstream ``Qwen2LM`` / ``CosyVoice3LM``, after ``cfg.lm_class``);
    ``state_dict()`` keys equal ``llm.pt``'s.

    Build with :func:`cosyserve.models.loader.load_llm` (weights from ``llm.pt``) or on any
    device with random weights. Call :meth:`setup_rope` after the weights are in place
    (the loader does) to build the rotary tables for ``max_positions``.
    """

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.cfg = cfg
        self.qwen_config = _qwen2_config(cfg)
        h = cfg.llm_input_size
        if cfg.has_llm_embedding:
            self.llm_embedding = nn.Embedding(2, h)
        self.llm = _Qwen2Holder(self.qwen_config)
        self.llm_decoder = nn.Linear(cfg.llm_output_size, cfg.num_speech_rows, bias=cfg.decoder_bias)
        self.speech_embedding = nn.Embedding(cfg.num_speech_rows, h)
        self._rope_cos: torch.Tensor | None = None
        self._rope_sin_signed: torch.Tensor | None = None
        self._fused: list[_FusedLayer] | None = None

    # ------------------------------------------------------------------ structure
    @property
    def backbone(self):
        """The ``transformers`` ``Qwen2Model`` (embeddings, layers, final norm, rotary)."""
        return self.llm.model.model

    @property
    def sos_id(self) -> int:
        """Row of the sos input in :attr:`prefix_table` (CosyVoice2: 0; CosyVoice3: ``S``)."""
        return 0 if self.cfg.sos_token is None else self.cfg.sos_token

    @property
    def task_id(self) -> int:
        """Row of the task-id input in :attr:`prefix_table` (CosyVoice2: 1; CosyVoice3: ``S + 2``)."""
        return 1 if self.cfg.task_id_token is None else self.cfg.task_id_token

    @property
    def prefix_table(self) -> nn.Embedding:
        """The table holding the sos / task-id rows: ``llm_embedding`` (CosyVoice2) or
        ``speech_embedding`` (CosyVoice3)."""
        return self.llm_embedding if self.cfg.has_llm_embedding else self.speech_embedding

    def reset_rotary(self, device=None) -> None:
        """Rebuild the backbone's rotary-embedding module (its buffers) on ``device``.

        Needed after building on the meta device: ``inv_freq`` is a non-persistent buffer
        that no checkpoint carries.
        """
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

        dev = device if device is not None else self.llm_decoder.weight.device
        with torch.device(dev):  # the constructor's signature differs across transformers versions
            self.backbone.rotary_emb = Qwen2RotaryEmbedding(self.qwen_config)

    def setup_rope(self, max_positions: int = 4096) -> None:
        """Precompute rotary ``cos``/``sin`` tables ``[max_positions, head_dim]`` (float32).

        Uses the backbone's own ``Qwen2RotaryEmbedding`` (rebuilt on the weights' device, so
        a model built on the meta device gets real ``inv_freq`` buffers).
        """
        dev = self.llm_decoder.weight.device
        self.reset_rotary(dev)
        rot = self.backbone.rotary_emb
        pos = torch.arange(max_positions, device=dev)[None]
        dummy = torch.zeros(1, device=dev, dtype=torch.float32)
        cos, sin = rot(dummy, pos)
        self._rope_cos, sin = cos[0].float(), sin[0].float()
        half = sin.shape[-1] // 2
        self._rope_sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self._fused_layers()  # the weights are in place: fuse the projections now, not in a capture

    def _fused_layers(self) -> list[_FusedLayer]:
        """The decoder layers' fused weights (:class:`_FusedLayer`), built on first use and
        again whenever a layer's parameters were replaced or moved (e.g. by ``.to()`` or a
        loader assigning new tensors). Building makes the original projections views of the
        fused tensors, so the model holds each weight once."""
        layers = self.backbone.layers
        fused = self._fused
        if fused is None or len(fused) != len(layers) or any(
                f.key != _FusedLayer.key_of(layer) for f, layer in zip(fused, layers)):
            self._fused = fused = [_FusedLayer.build(layer) for layer in layers]
        return fused

    @property
    def max_positions(self) -> int:
        return 0 if self._rope_cos is None else self._rope_cos.shape[0]

    # ------------------------------------------------------------------ inputs
    def embed_prefix(
        self, text_ids: torch.Tensor, prompt_text_ids: torch.Tensor, prompt_speech_tokens: torch.Tensor
    ) -> torch.Tensor:
        """Input embeddings of a request's prefix, as upstream ``Qwen2LM.inference`` (sos and
        task id from ``llm_embedding`` for CosyVoice2, from ``speech_embedding`` for CosyVoice3).

        Args: 1-D integer tensors ``text_ids [Lt]`` (text to speak), ``prompt_text_ids [Lp]``
        (prompt transcript or instruction, may be empty), ``prompt_speech_tokens [Ps]``
        (speech tokens of the prompt audio, may be empty).
        Returns ``[1 + Lp + Lt + 1 + Ps, H]`` in the LM dtype. (CosyVoice3's requirement that
        the text hold ``<|endofprompt|>`` is checked by the frontend, which knows its id.) Host ids
        go to the device through pinned memory (:func:`~cosyserve.models.transfer.to_device`): a
        plain copy from pageable memory would make the scheduler wait for the LM stream's queued work.
        """
        table = self.prefix_table.weight
        dev = table.device
        text = to_device(torch.cat([prompt_text_ids.reshape(-1), text_ids.reshape(-1)]).long(), dev)
        parts = [
            table[self.sos_id : self.sos_id + 1],
            self.backbone.embed_tokens(text),
            table[self.task_id : self.task_id + 1],
        ]
        if prompt_speech_tokens.numel():
            parts.append(self.speech_embedding(to_device(prompt_speech_tokens.reshape(-1).long(), dev)))
        return torch.cat(parts, dim=0)

    def embed_speech(self, tokens: torch.Tensor) -> torch.Tensor:
        """``speech_embedding`` rows for integer ``tokens`` of any shape -> ``[..., H]``."""
        return self.speech_embedding(to_device(tokens.long(), self.speech_embedding.weight.device))

    # ------------------------------------------------------------------ backbone
    def forward_cached(
        self,
        embeds: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor | slice,
        start: torch.Tensor,
        kv_len: int | None = None,
    ) -> torch.Tensor:
        """Run the Qwen2 decoder on new positions of several slots; update the cache.

        Args:
          embeds: ``[B, T, H]`` input embeddings; row ``b`` holds positions
            ``start[b] .. start[b] + T - 1`` of the sequence in slot ``slots[b]``.
          cache: the :class:`KVCache` (modified in place).
          slots: ``[B]`` long tensor of slot indices, or a ``slice`` of ``B`` consecutive slots
            (cheaper: the cache is then read as a view instead of gathered, and written with
            one scatter per layer instead of an indexed put).
          start: ``[B]`` long tensor, number of positions already in each slot.
          kv_len: cache positions attention reads (default: the longest sequence, which costs
            one host synchronisation); pass it to get static shapes (CUDA graphs).
        Returns the final-norm hidden states ``[B, T, H]``.

        Each query attends causally to its slot's positions ``0 .. start[b] + t`` (an additive
        ``-inf`` bias built once per call, shared by the layers). Attention reads the cache up
        to the longest sequence in the batch, so its cost follows the actual lengths. No host
        synchronisation except for that length (one ``max``).
        """
        if self._rope_cos is None:
            raise RuntimeError("call setup_rope() before decoding")
        bsz, t_new, _ = embeds.shape
        dev = embeds.device
        qc = self.qwen_config
        n_heads = qc.num_attention_heads
        start = start.to(dev, torch.long)
        pos = start[:, None] + torch.arange(t_new, device=dev)[None]  # [B, T]
        if kv_len is None:
            kv_len = int(pos.max().item()) + 1
        if kv_len > cache.max_len or kv_len > self.max_positions:
            raise ValueError(f"sequence length {kv_len} exceeds the KV cache ({cache.max_len}) or rope table")
        n_kv = qc.num_key_value_heads
        head_dim = self._rope_cos.shape[-1]
        silu = getattr(qc, "hidden_act", None) == "silu"  # Qwen2's MLP: one fused kernel
        cos = self._rope_cos[pos][:, :, None]  # [B, T, 1, D] float32
        sin_signed = self._rope_sin_signed[pos][:, :, None]
        key_pos = torch.arange(kv_len, device=dev)
        # [B, 1, T, Lk] additive bias (0 visible, -inf not); SDPA would convert a boolean mask
        # into the same bias once per layer
        bias = torch.zeros((), dtype=embeds.dtype, device=dev).masked_fill(
            key_pos[None, None, None, :] > pos[:, None, :, None], float("-inf"))
        if isinstance(slots, slice):  # rows are the slots: written by scatter, read as views
            write_idx = pos[:, None, :, None].expand(bsz, n_kv, t_new, head_dim)
        else:  # rows name their slots: written by indexed put, read by gather
            slot_idx = slots.to(dev, torch.long)
            write_slots = slot_idx[:, None].expand(bsz, t_new)

        h = embeds
        hdim = h.shape[-1]
        for li, fl in enumerate(self._fused_layers()):
            x = F.rms_norm(h, (hdim,), fl.ln1_w, fl.ln1_eps)
            qkv = F.linear(x, fl.qkv_w, fl.qkv_b).view(bsz, t_new, n_heads + 2 * n_kv, head_dim)
            qk = _rope(qkv[:, :, : n_heads + n_kv], cos, sin_signed)  # queries and keys together
            k, v = qk[:, :, n_heads:], qkv[:, :, n_heads + n_kv:]  # [B, T, n_kv, D]
            kc, vc = cache.k[li], cache.v[li]
            if isinstance(slots, slice):  # the rows' slots as views [B, n_kv, max_len, D]
                kc, vc = kc[slots], vc[slots]
                kc.scatter_(2, write_idx, k.transpose(1, 2))
                vc.scatter_(2, write_idx, v.transpose(1, 2))
                keys, vals = kc[:, :, :kv_len], vc[:, :, :kv_len]
            else:
                kc[write_slots, :, pos] = k
                vc[write_slots, :, pos] = v
                keys, vals = kc[slot_idx, :, :kv_len], vc[slot_idx, :, :kv_len]
            if t_new == 1:
                # one query per row: fold each KV head's query group into the query axis, so the
                # fused (memory-efficient) kernel serves the masked grouped-query attention
                qg = qk[:, 0, :n_heads].reshape(bsz, n_kv, n_heads // n_kv, head_dim)
                o = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=bias)
            else:
                q = qk[:, :, :n_heads].transpose(1, 2)
                o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=bias, enable_gqa=True)
                o = o.transpose(1, 2)
            h = _add_linear(h, o.reshape(bsz * t_new, n_heads * head_dim), fl.o_w, fl.o_b)
            x = F.rms_norm(h, (hdim,), fl.ln2_w, fl.ln2_eps)
            gate_up = F.linear(x, fl.gate_up_w, fl.gate_up_b)
            if silu:
                act = _silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = fl.act(gate) * up
            h = _add_linear(h, act.reshape(bsz * t_new, -1), fl.down_w, fl.down_b)
        norm = self.backbone.norm
        return F.rms_norm(h, (hdim,), norm.weight, _rms_eps(norm))

    def decode_sample(self, cache: KVCache, state: DecodeState, slots: torch.Tensor | slice, start: torch.Tensor,
                      seed: torch.Tensor, step: torch.Tensor, ignore_eos: torch.Tensor, sampling, eos_id: int,
                      kv_len: int | None = None, active: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step with device sampling that takes its inputs from ``state``.

        Row ``b`` feeds ``state.last[slots[b]]`` at position ``start[b]`` of slot ``slots[b]``
        (``slots``: device int64 ``[B]`` or a ``slice`` of ``B`` consecutive slots, see
        :meth:`forward_cached`), samples its next token with
        :func:`~cosyserve.models.sampling.ras_sample_device` (``seed``, ``step``, ``ignore_eos``
        int64/bool ``[B]`` device tensors; ``eos_id`` is the id masked where ``ignore_eos``,
        ``cfg.min_len_mask_id``; the repetition window is ``state.recent[slots]``) and
        appends it to ``state`` — no host synchronisation (pass ``kv_len``), so it can be
        captured in a CUDA graph and the next step issued before this one's tokens are read.
        ``active`` (bool ``[B]``, default all): rows whose token is appended to ``state``; the
        others are computed and discarded (their cache writes must go where nothing reads).
        Returns ``(log-probs [B, S+E] float32, tokens [B] int64)``.
        """
        toks = state.last[slots]
        recent = state.recent[slots]
        h = self.forward_cached(self.embed_speech(toks[:, None]), cache, slots, start, kv_len=kv_len)[:, -1]
        logp = self.logprobs(h)
        tok = ras_sample_device(logp, recent, seed, step, ignore_eos, sampling, eos_id)
        state.push(slots, tok, active)
        return logp, tok

    def forward_full(self, embeds: torch.Tensor) -> torch.Tensor:
        """Plain causal forward of one full sequence through transformers' own ``Qwen2Model``.

        ``embeds [1, L, H]`` -> final hidden ``[1, L, H]``. A cross-check of
        :meth:`forward_cached` against the library implementation (used in tests).
        """
        out = self.backbone(inputs_embeds=embeds, use_cache=False)
        return out.last_hidden_state

    def logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """``log_softmax(llm_decoder(hidden))`` in float32: ``[..., H] -> [..., S+E]``."""
        return self.llm_decoder(hidden).float().log_softmax(dim=-1)

    # ------------------------------------------------------------------ reference decoding
    @torch.inference_mode()
    def generate(
        self,
        text_ids: torch.Tensor,
        prompt_text_ids: torch.Tensor,
        prompt_speech_tokens: torch.Tensor,
        *,
        generator: torch.Generator | None = None,
        min_token_text_ratio: float = 2.0,
        max_token_text_ratio: float = 20.0,
        sampler: UpstreamSampler | None = None,
        cache: KVCache | None = None,
        slot: int = 0,
    ) -> Iterator[int]:
        """Decode speech tokens for one request, one at a time (upstream ``Qwen2LM.inference``).

        Lengths: ``min_len = int(len(text_ids) * min_token_text_ratio)`` steps during which
        id ``cfg.min_len_mask_id`` is masked (CosyVoice2's end-of-speech; CosyVoice3's sos, as
        upstream), at most ``max_len = int(len(text_ids) * max_token_text_ratio)``
        tokens (the prompt text does not count). Sampling: repetition-aware sampling with the
        yaml's top-p/top-k/window/tau_r, drawing from ``generator`` (CPU) exactly as upstream
        draws from torch's global generator, so a generator seeded with ``s`` reproduces
        upstream after ``torch.manual_seed(s)``.
        Yields speech-token ids in ``[0, S)``; stops at a stop id (any extra id) or ``max_len``.
        Yields every token the LM decodes (upstream ``llm_job``'s silent-token dropping is a
        token2wav-side filter: :class:`SilentTokenFilter`).
        """
        sampler = sampler or UpstreamSampler(self.cfg.sampling, eos_id=self.cfg.min_len_mask_id)
        n_text = int(text_ids.numel())
        min_len = int(n_text * min_token_text_ratio)
        max_len = int(n_text * max_token_text_ratio)
        prefix = self.embed_prefix(text_ids, prompt_text_ids, prompt_speech_tokens)
        if cache is None:
            cache = KVCache.allocate(self, 1, prefix.shape[0] + max_len + 1)
            slot = 0
        if self.max_positions < prefix.shape[0] + max_len + 1:
            self.setup_rope(prefix.shape[0] + max_len + 1)
        slots = torch.tensor([slot])
        hidden = self.forward_cached(prefix[None], cache, slots, torch.zeros(1, dtype=torch.long))[:, -1]
        length = prefix.shape[0]
        out: list[int] = []
        stop = set(self.cfg.stop_token_ids)
        for i in range(max_len):
            logp = self.logprobs(hidden)[0]
            tok = sampler.sample(logp, out, generator=generator, ignore_eos=i < min_len)
            if tok in stop:
                break
            yield tok
            out.append(tok)
            emb = self.embed_speech(torch.tensor([[tok]]))
            hidden = self.forward_cached(emb, cache, slots, torch.tensor([length]))[:, -1]
            length += 1


class SilentTokenFilter:
    """Upstream ``llm_job``'s rule: of consecutive "silent" speech tokens (``cfg.silent_tokens``,
    CosyVoice3's FSQ silence/breath codes) only the first ``cfg.max_silent_tokens`` go on to
    token2wav; later ones in the run are dropped (any other token resets the run). The LM's own
    history keeps every token (it conditions the repetition window and the next step).

    One instance per decoded segment. ``keep(token) -> bool`` says whether ``token`` goes to
    token2wav; with an empty ``silent_tokens`` (CosyVoice2) every token is kept.
    Source: ``cosyvoice/cli/model.py`` ``CosyVoice2Model.llm_job`` / ``CosyVoice3Model.silent_tokens``.
    """

    __slots__ = ("silent", "max_run", "run")

    def __init__(self, silent_tokens, max_run: int):
        self.silent = frozenset(int(t) for t in silent_tokens)
        self.max_run = int(max_run)
        self.run = 0

    @classmethod
    def for_config(cls, cfg: LLMConfig) -> "SilentTokenFilter":
        return cls(cfg.silent_tokens, cfg.max_silent_tokens)

    def keep(self, token: int) -> bool:
        if token in self.silent:
            self.run += 1
            return self.run <= self.max_run
        self.run = 0
        return True

    def filter(self, tokens) -> list[int]:
        """``[t for t in tokens if keep(t)]`` (advances the state)."""
        return [int(t) for t in tokens if self.keep(int(t))]
