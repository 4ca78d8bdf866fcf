"""CosyVoice2 flow model: speech tokens (25/s) -> 80-bin natural-log mel (50 frames/s).

Algorithm source: CosyVoice commit ace7c47, ``cosyvoice/flow/flow.py``
(``CausalMaskedDiffWithXvec.inference``) and ``cosyvoice/flow/flow_matching.py``
(``CausalConditionalCFM``), with the encoder in :mod:`cosyserve.models.flow_encoder` and
the velocity estimator in :mod:`cosyserve.models.flow_estimator`. Independent plain-torch
re-implementation; ``FlowModel.state_dict()`` has exactly the keys and shapes of the
official ``flow.pt``.

Per utterance (upstream semantics):

1. ``spks = spk_embed_affine_layer(l2_normalize(embedding))`` -> ``[n_mels]``.
2. Tokens ``[prompt_token, token]`` (``L = P + N``) are embedded (ids clamped at 0) and
   encoded (see :mod:`~cosyserve.models.flow_encoder`); with ``finalize=False`` the last
   ``pre_lookahead_len`` tokens are look-ahead context only, so ``T = ratio * (L - 3)``
   mel frames come out, else ``T = ratio * L``. ``mu = encoder_proj(h)``.
3. ``cond`` holds ``prompt_feat`` in its first ``F`` frames (``F = prompt_feat.shape[1]``,
   normally ``ratio * P``) and zeros after.
4. Conditional flow matching, Euler solver, ``n_timesteps`` (10) steps from the fixed
   noise ``rand_noise[:, :, :T]`` (a constant buffer, ``torch.randn`` of a generator seeded
   ``noise_seed``; upstream: ``torch.manual_seed(0); torch.randn(1, 80, 15000)``). Time grid
   ``t_k = 1 - cos(k / n * pi / 2)`` (cosine scheduler) and, exactly as upstream,
   ``t <- t + dt`` with ``dt = t_span[k + 1] - t`` recomputed from the accumulated ``t``.
   Classifier-free guidance: one estimator call on ``2B`` rows (conditional rows, then
   unconditional rows with ``mu``, ``spks`` and ``cond`` zeroed),
   ``v = (1 + r) * v_cond - r * v_uncond`` with ``r = inference_cfg_rate`` (0.7).
   In streaming mode the estimator's attention is chunk-causal (``static_chunk_size`` mel
   frames, chunks counted from the first prompt frame).
5. The first ``F`` (prompt) frames are dropped; the result is returned as float32.

Batching (:meth:`FlowModel.inference_batch`) pads items on the right and gives every item
its own masks, streaming/finalize behaviour and noise prefix; results equal single-item
results up to float summation order (relative L2 ~1e-7 in float32).

Streaming (issue 17): a per-stream :class:`FlowStreamCache` passed to :meth:`FlowModel.start` /
:meth:`FlowModel.inference_batch` keeps the encoder's and the estimator's work on the frames of
complete static chunks (every Euler step's keys/values and causal-conv contexts, both CFG rows),
so a later streaming call of the stream computes only the frames from the first chunk that was
incomplete; exact by the chunk-causal structure (docs/architecture.md, "Flow stream cache").

Host synchronisation: none on CUDA (inputs on the CPU are copied through pinned memory,
:mod:`~cosyserve.models.transfer`), so a batch can be issued on a side stream while other
work keeps the GPU busy.

Numerics: float32 by default; the model may be cast to bfloat16/float16 (``.to(dtype)``),
in which case every computation, including the Euler time grid, runs in that dtype as
upstream does under autocast, and the returned mel is cast to float32.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from ..errors import ConfigError
from .config import CFMConfig, EstimatorConfig, FlowConfig
from .flow_encoder import EncoderStreamCache, UpsampleConformerEncoder, segment_index
from .flow_estimator import EstimatorStreamCache, FlowEstimator
from .flow_prefix import PrefixPlan, PrefixPool
from .transfer import to_device

__all__ = ["FlowModel", "FlowConditioning", "FlowInputs", "FlowRun", "CausalFlowMatching", "SolverState",
           "FlowStreamCache"]


@dataclass
class FlowConditioning:
    """Everything the flow-matching solver needs for a right-padded batch of ``B`` items.

    Attributes:
        encoder_out: ``[B, T, encoder.output_size]`` encoder output (after its final
            LayerNorm, before ``encoder_proj``), model dtype.
        mu: ``[B, n_mels, T]`` ``encoder_proj(encoder_out)``, zero at padded frames.
        spks: ``[B, n_mels]`` projected speaker vector.
        cond: ``[B, n_mels, T]`` prompt log-mel in the first ``prompt_frames[b]`` frames, zeros after.
        mask: ``[B, 1, T]`` 1 at each item's ``mel_lengths[b]`` valid frames, 0 after (model dtype).
        streaming: ``[B]`` bool, chunk-causal estimator attention per item.
        mel_lengths: frames per item, prompt included (50 frames/s).
        prompt_frames: prompt frames per item (removed from the output).
    """

    encoder_out: Tensor
    mu: Tensor
    spks: Tensor
    cond: Tensor
    mask: Tensor
    streaming: Tensor
    mel_lengths: tuple[int, ...]
    prompt_frames: tuple[int, ...]


@dataclass
class FlowInputs:
    """A validated flow batch, right-padded, before anything runs on the device
    (:meth:`FlowModel.prepare`); tensors are on the device the caller's inputs were on.

    Attributes:
        ids: ``[B, L]`` int64: prompt speech tokens then tokens (look-ahead included), 0-padded.
        lengths: ``[3, B]`` int64: tokens, encoder positions (tokens minus look-ahead for a
            non-final chunk) and mel frames (prompt included) per item.
        streaming: ``[B]`` bool; embeddings: ``[B, spk_embed_dim]`` float32 speaker x-vectors;
        feats: ``[B, F, n_mels]`` float32 prompt log-mel, zero-padded to the longest prompt.
        mel_lengths, prompt_frames: host copies of the frame counts; max_encoder_len: the
            largest encoder length (the eager encoder's sequence length).
    """

    ids: Tensor
    lengths: Tensor
    streaming: Tensor
    embeddings: Tensor
    feats: Tensor
    mel_lengths: tuple[int, ...]
    prompt_frames: tuple[int, ...]
    max_encoder_len: int


class CausalFlowMatching(nn.Module):
    """Conditional flow matching sampler (upstream ``CausalConditionalCFM`` at inference).

    Holds the velocity estimator (``estimator``: CosyVoice2's
    :class:`~cosyserve.models.flow_estimator.FlowEstimator`, or a module given to the
    constructor with the same ``attention_plan`` / ``forward_btc`` methods) and
    the fixed start noise ``rand_noise`` ``[1, n_mels, noise_frames]`` (non-persistent
    buffer, not in ``flow.pt``; drawn on CPU with a private ``torch.Generator`` seeded
    ``noise_seed``, so the global RNG is never touched, then placed on the construction
    device; under ``torch.device("meta")`` it stays on CPU so that its values survive
    ``load_state_dict(assign=True)``, and it follows the parameters on first use).
    """

    def __init__(self, cfm: CFMConfig, estimator: EstimatorConfig | nn.Module, n_mels: int,
                 exact_cfg: bool = False):
        super().__init__()
        #: True: the CFG update in upstream's exact arithmetic, ``x + dt * ((1 + r) v_c - r v_u)``
        #: (two kernels more per step). CosyVoice3 needs it: its HiFT re-runs over the whole mel and
        #: integrates F0 into the excitation phase, which turns the ~1e-7 rounding difference of the
        #: fused ``lerp`` form into ~1e-4 on the speech. False (CosyVoice2): ``lerp`` (see :meth:`step`).
        self.exact_cfg = exact_cfg
        if cfm.t_scheduler not in ("cosine", "linear"):
            raise ConfigError(f"flow decoder: t_scheduler {cfm.t_scheduler!r} unsupported")
        self.cfm = cfm
        self.n_mels = n_mels
        # an EstimatorConfig builds CosyVoice2's U-Net; any module with the same two methods
        # (``attention_plan(mask, streaming)``, ``forward_btc(packed, plan, t)``) may be given
        # instead (CosyVoice3's DiT, :mod:`cosyserve.models.cv3_flow`)
        self.estimator = estimator if isinstance(estimator, nn.Module) else FlowEstimator(estimator)
        gen = torch.Generator(device="cpu").manual_seed(cfm.noise_seed)
        noise = torch.randn(1, n_mels, cfm.noise_frames, generator=gen, device="cpu")
        target = torch.empty(0).device  # honours an enclosing `with torch.device(...)`
        if target.type != "meta":  # on meta keep the real values (CPU) so assign-loading keeps them
            noise = noise.to(target)
        self.register_buffer("rand_noise", noise, persistent=False)

    def time_span(self, n_timesteps: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """``[n_timesteps + 1]`` time grid in ``dtype``: linspace(0, 1), cosine-warped if configured."""
        t = torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=dtype)
        if self.cfm.t_scheduler == "cosine":
            t = 1 - torch.cos(t * 0.5 * torch.pi)
        return t

    def noise(self, frames: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """``rand_noise[:, :, :frames]`` as ``[1, n_mels, frames]``; ValueError past the buffer."""
        if frames > self.rand_noise.size(-1):
            raise ValueError(
                f"flow: {frames} mel frames exceed the fixed noise buffer of {self.rand_noise.size(-1)} frames"
                f" ({self.rand_noise.size(-1) / 50:.0f} s at 50 frames/s)"
            )
        if self.rand_noise.device != device:
            # e.g. parameters assigned onto another device after a meta build: move once, not per call
            self.rand_noise = self.rand_noise.to(device)
        return self.rand_noise[:, :, :frames].to(dtype=dtype)

    def solve(self, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor, streaming: Tensor,
              n_timesteps: int | None = None) -> Tensor:
        """Integrate the flow ODE from the fixed noise to a mel batch.

        Args:
            mu, cond: ``[B, n_mels, T]``; mask: ``[B, 1, T]``; spks: ``[B, n_mels]``; all in
                the model dtype. streaming: ``[B]`` bool.
            n_timesteps: Euler steps (default ``CFMConfig.n_timesteps``).

        Returns:
            ``[B, n_mels, T]`` float32 (padded frames are not meaningful). The loop performs
            no host synchronisation. Equals :meth:`begin`, ``n`` x :meth:`step`, ``state.mels()``.
        """
        state = self.begin(mu, mask, spks, cond, streaming, n_timesteps)
        for _ in range(state.n):
            self.step(state)
        return state.mels()

    def begin(self, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor, streaming: Tensor,
              n_timesteps: int | None = None, x0: Tensor | None = None, plan=None) -> "SolverState":
        """The solver's state before the first Euler step (arguments as :meth:`solve`); the
        CFG inputs (conditional rows, then unconditional rows with ``mu``, ``spks``, ``cond``
        zeroed) and the attention masks are built once here. ``x0`` ``[B, T, n_mels]``: the
        start state instead of the fixed noise's first ``T`` frames; ``plan``: the estimator's
        plan instead of one built from ``mask`` (a stream-cached solve,
        :meth:`FlowModel.start`)."""
        n = self.cfm.n_timesteps if n_timesteps is None else int(n_timesteps)
        b, n_mels, frames = mu.shape
        dtype, device = mu.dtype, mu.device
        t_span = self.time_span(n, device, dtype)
        # the estimator's packed input, frame-major: [x | mu | spks | cond] for the conditional
        # rows, [x | 0 | 0 | 0] for the unconditional ones; each step rewrites only the x columns
        inp = torch.zeros(2 * b, frames, 4 * n_mels, device=device, dtype=dtype)
        inp[:b, :, n_mels:2 * n_mels] = mu.transpose(1, 2)
        inp[:b, :, 2 * n_mels:3 * n_mels] = spks.unsqueeze(1)
        inp[:b, :, 3 * n_mels:] = cond.transpose(1, 2)
        if x0 is None:
            x0 = self.noise(frames, device, dtype).transpose(1, 2).expand(b, -1, -1)
        if plan is None:
            plan = self.estimator.attention_plan(torch.cat([mask, mask]), torch.cat([streaming, streaming]))
        return SolverState(
            xt=x0.to(dtype).contiguous(),
            t=t_span[0].clone(), dt=t_span[1] - t_span[0], k=torch.zeros((), dtype=torch.long, device=device),
            t_span=t_span, n=n, inp=inp, plan=plan,
        )

    def step(self, s: "SolverState") -> None:
        """One Euler step with CFG, in place on ``s.xt``, ``s.t``, ``s.dt``, ``s.k`` (fixed
        addresses, so a captured step can be replayed ``n`` times). Upstream's arithmetic:
        ``x += dt * ((1 + r) v_cond - r v_uncond)`` (here ``lerp(v_uncond, v_cond, 1 + r)``),
        ``t += dt``, then ``dt = t_span[k + 1] - t`` from the accumulated ``t``. No host
        synchronisation."""
        b, frames, n_mels = s.xt.shape
        s.inp.view(2, b, frames, -1)[..., :n_mels].copy_(s.xt.unsqueeze(0).expand(2, -1, -1, -1))
        v = self.estimator.forward_btc(s.inp, s.plan, s.t.view(1))  # [2B, T, n_mels]
        r = self.cfm.inference_cfg_rate
        if self.exact_cfg:
            s.xt.add_(s.dt * ((1.0 + r) * v[:b] - r * v[b:]))
        else:
            s.xt.addcmul_(torch.lerp(v[b:], v[:b], 1.0 + r), s.dt)
        s.t.add_(s.dt)
        s.k.add_(1)
        nxt = torch.clamp(s.k + 1, max=s.n).view(1)  # the last step's dt is never used
        s.dt.copy_(s.t_span.index_select(0, nxt).view(()) - s.t)


@dataclass
class SolverState:
    """The flow ODE solver between Euler steps (:meth:`CausalFlowMatching.begin` / ``step``).

    ``xt`` ``[B, T, n_mels]`` the state frame-major (:attr:`x` is its ``[B, n_mels, T]`` view),
    ``t`` / ``dt`` 0-dim (model dtype), ``k`` 0-dim int64 (steps done), ``t_span`` ``[n + 1]``;
    ``inp`` ``[2B, T, 4 n_mels]`` the estimator's packed CFG input (conditional rows
    ``[x | mu | spks | cond]``, then unconditional rows ``[x | 0 | 0 | 0]``) and the estimator's
    :class:`~cosyserve.models.flow_estimator.AttentionPlan`.
    """

    xt: Tensor
    t: Tensor
    dt: Tensor
    k: Tensor
    t_span: Tensor
    n: int
    inp: Tensor
    plan: object

    @property
    def x(self) -> Tensor:
        """``[B, n_mels, T]`` (a transposed view of :attr:`xt`)."""
        return self.xt.transpose(1, 2)

    def mels(self, rows: int | None = None) -> Tensor:
        """The first ``rows`` (default all) rows of :attr:`x` as a new contiguous float32 tensor
        ``[rows, n_mels, T]`` — never a view of the solver's buffers, which a graph bucket's next
        batch overwrites."""
        return self.x[:rows].to(torch.float32, memory_format=torch.contiguous_format, copy=True)


def _as_1d(x: Tensor, what: str, index: int) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"flow: {what}[{index}] must be a tensor, got {type(x).__name__}")
    if x.dim() == 2 and x.size(0) == 1:
        x = x[0]
    if x.dim() != 1:
        raise ValueError(f"flow: {what}[{index}] must have shape [1, n] or [n], got {tuple(x.shape)}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise ValueError(f"flow: {what}[{index}] must hold integer speech-token ids, got {x.dtype}")
    return x


def _flags(value: bool | Sequence[bool], n: int, what: str) -> list[bool]:
    if isinstance(value, (bool, int)):
        return [bool(value)] * n
    flags = [bool(v) for v in value]
    if len(flags) != n:
        raise ValueError(f"flow: {what} has {len(flags)} entries for {n} items")
    return flags


class FlowRun:
    """A flow batch being issued step by step (:meth:`FlowModel.start`).

    ``steps_left``: Euler steps not yet issued; :meth:`step` issues the next one (no host
    synchronisation); :meth:`mels` (after the last step) returns per item the float32 log-mel
    ``[1, n_mels, T_b]`` of its non-prompt frames, as :meth:`FlowModel.inference_batch` (views
    of one fresh tensor, never of the solver's buffers) — for a stream-cached item only those
    from :attr:`mel_starts` on (the earlier ones were computed by earlier calls of the stream).
    """

    def __init__(self, step, state: SolverState, inputs: FlowInputs, starts: Sequence[int] | None = None):
        self._step = step
        self.state = state
        self.inputs = inputs
        self.steps_left = state.n
        #: per item the first frame (prompt included) the solver state holds: 0, or for a
        #: stream-cached item its cached frames (the state then holds frames ``starts[b]`` on)
        self.starts = tuple(starts) if starts is not None else (0,) * inputs.ids.shape[0]

    @property
    def cost_key(self) -> tuple[int, int]:
        """``(rows, frames)`` of the solver state (with CUDA graphs: its bucket, padding included):
        what one Euler step's device time depends on (the engine's
        :class:`~cosyserve.engine.token2wav.FlowStepTimes`)."""
        return int(self.state.xt.shape[0]), int(self.state.xt.shape[1])

    @property
    def mel_starts(self) -> tuple[int, ...]:
        """Per item the first non-prompt frame :meth:`mels` returns (``max(0, starts - prompt
        frames)``; 0 without stream caches)."""
        return tuple(max(0, s - p) for s, p in zip(self.starts, self.inputs.prompt_frames))

    @torch.inference_mode()
    def step(self) -> None:
        if self.steps_left <= 0:
            raise RuntimeError("all Euler steps were already issued")
        self._step()
        self.steps_left -= 1

    @torch.inference_mode()
    def mels(self) -> list[Tensor]:
        if self.steps_left:
            raise RuntimeError(f"{self.steps_left} Euler steps not issued yet")
        b = self.inputs.ids.shape[0]
        # a copy even in float32: with CUDA graphs ``state.x`` is the bucket's static buffer, which
        # the next batch overwrites while callers (HiFT's stream cache) may still hold these frames
        mel = self.state.mels(b)
        return [mel[i:i + 1, :, max(p, s) - s:n - s]
                for i, (p, n, s) in enumerate(zip(self.inputs.prompt_frames, self.inputs.mel_lengths, self.starts))]


class FlowStreamCache:
    """Per-stream state of the exactly removable flow work of streaming calls (issue 17).

    One object per stream (the engine keeps it in the segment's state and passes it with every
    non-final chunk's job); :meth:`FlowModel.start` reads it and, after the solve's last Euler
    step, extends it to the frames of this call's complete static chunks. Holds:

    * ``estimator``: :class:`~cosyserve.models.flow_estimator.EstimatorStreamCache`, per Euler step
      and CFG row the attention keys/values of every transformer block and the causal
      convolutions' left context for the first ``frames`` mel frames (prompt included);
    * ``encoder``: :class:`~cosyserve.models.flow_encoder.EncoderStreamCache`, both conformer
      stages' keys/values and the upsampling's left context for the same frames;
    * ``ids``: CPU int64 ``[L]``: the prompt + token ids of the call that last used it; a later
      call whose ids do not start with them, has another prompt length, step count or dtype,
      starts from an empty cache (never a wrong one);
    * ``max_frames``: bound on cached frames (None: unbounded). Frames past it are recomputed
      every call (still exact). Memory at ``frames``: ``frames * n_timesteps *
      FlowEstimator.stream_cache_values_per_frame()`` values of the model dtype, plus the
      convolutions' contexts (a few frames).

    :meth:`clear` frees everything (the engine calls it at the final chunk / request end; the
    final, non-streaming call uses full attention and never reads it).
    """

    def __init__(self, max_frames: int | None = None):
        if max_frames is not None and max_frames < 0:
            raise ValueError(f"flow stream cache: max_frames must be >= 0, got {max_frames}")
        self.max_frames = max_frames
        self.estimator = EstimatorStreamCache()
        self.encoder = EncoderStreamCache()
        self.ids: Tensor | None = None
        self.prompt_frames = -1
        self.dtype: torch.dtype | None = None
        #: the next call commits at most this many frames (then None again): how a stream's first call
        #: builds a voice's prompt prefix (:meth:`prompt_prefix`) without a call of its own
        self.commit_limit: int | None = None

    def prompt_prefix(self, prompt_tokens: int) -> "FlowStreamCache":
        """A cache holding what this one holds, for any stream of the same voice: the same tensors
        (shared, never copied: a solve replaces a cache's tensors, it never writes into them) and the
        first ``prompt_tokens`` ids only, so that every call whose ids start with the prompt can use it.
        Only exact when this cache's frames depend on the prompt alone (at most
        :meth:`FlowModel.prompt_prefix_frames`); the caller also keys it by the prompt mel and speaker
        embedding, which :meth:`_usable` does not check. Raises ValueError on an empty cache or one
        built over fewer ids."""
        if self.frames == 0 or self.ids is None or self.ids.numel() < prompt_tokens:
            raise ValueError(f"flow stream cache: no prompt prefix of {prompt_tokens} tokens in a cache of "
                             f"{self.frames} frames")
        out = FlowStreamCache()
        out.estimator, out.encoder = copy.copy(self.estimator), copy.copy(self.encoder)
        out.ids, out.prompt_frames, out.dtype = self.ids[:prompt_tokens].clone(), self.prompt_frames, self.dtype
        return out

    def adopt(self, prefix: "FlowStreamCache") -> None:
        """Start from ``prefix`` (:meth:`prompt_prefix` of a stream of the same voice): its tensors are
        shared until this cache's next commit replaces them with its own."""
        self.estimator, self.encoder = copy.copy(prefix.estimator), copy.copy(prefix.encoder)
        self.ids, self.prompt_frames, self.dtype = prefix.ids, prefix.prompt_frames, prefix.dtype

    @property
    def frames(self) -> int:
        """Mel frames (prompt included) whose estimator work is cached."""
        return self.estimator.frames

    def nbytes(self) -> int:
        """Bytes of device memory held."""
        return self.estimator.nbytes() + self.encoder.nbytes()

    def clear(self) -> None:
        """Free every cached tensor."""
        self.estimator.clear()
        self.encoder.clear()
        self.ids, self.prompt_frames, self.dtype = None, -1, None

    def _usable(self, ids: Tensor, prompt_frames: int, n_steps: int, dtype: torch.dtype) -> int:
        """Cached frames valid for a call over ``ids`` (CPU int64), else 0 (and cleared)."""
        e = self.estimator
        ok = (e.frames > 0 and self.ids is not None and self.prompt_frames == prompt_frames
              and e.n_steps == n_steps and self.dtype == dtype and ids.numel() >= self.ids.numel()
              and torch.equal(ids[:self.ids.numel()], self.ids))
        if not ok:
            self.estimator.clear()
            self.encoder.clear()
            return 0
        return e.frames


class FlowModel(nn.Module):
    """CosyVoice2 ``CausalMaskedDiffWithXvec`` for inference (speech tokens -> log-mel).

    Sub-modules (names = ``flow.pt`` key prefixes): ``input_embedding``
    (``[vocab_size, input_size]``), ``spk_embed_affine_layer`` (``spk_embed_dim -> n_mels``),
    ``encoder`` (:class:`~cosyserve.models.flow_encoder.UpsampleConformerEncoder`),
    ``encoder_proj`` (``encoder.output_size -> n_mels``), ``decoder``
    (:class:`CausalFlowMatching`, with ``decoder.estimator``). All sizes come from
    :class:`~cosyserve.models.config.FlowConfig`; raises
    :class:`~cosyserve.errors.ConfigError` on inconsistent sizes.
    """

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        n_mels = cfg.output_size
        if cfg.cfm.spk_emb_dim != n_mels:
            raise ConfigError(f"flow: decoder spk_emb_dim {cfg.cfm.spk_emb_dim} must equal output_size {n_mels}")
        if cfg.estimator.in_channels != 4 * n_mels or cfg.estimator.out_channels != n_mels:
            raise ConfigError(
                f"flow: estimator in/out channels {cfg.estimator.in_channels}/{cfg.estimator.out_channels} "
                f"must be {4 * n_mels}/{n_mels}"
            )
        if cfg.input_size != cfg.encoder.input_size:
            raise ConfigError(f"flow: input_size {cfg.input_size} != encoder input_size {cfg.encoder.input_size}")
        self.cfg = cfg
        self.n_mels = n_mels
        self.token_mel_ratio = cfg.encoder.upsample_stride
        self.pre_lookahead_len = cfg.encoder.pre_lookahead_len
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, n_mels)
        self.encoder = UpsampleConformerEncoder(cfg.encoder)
        self.encoder_proj = nn.Linear(cfg.encoder.output_size, n_mels)
        self.decoder = CausalFlowMatching(cfg.cfm, cfg.estimator, n_mels)
        #: optional :class:`~cosyserve.models.graphs.GraphedFlow` (encoder + solve as CUDA graphs),
        #: used by :meth:`inference_batch` on CUDA with the default number of steps
        self.graph = None
        #: optional :class:`~cosyserve.models.graphs.GraphedPrefixFlow` (prefixed solves as CUDA graphs),
        #: used by :meth:`start_prefixed` on CUDA with the default number of steps
        self.prefix_graph = None

    @property
    def rand_noise(self) -> Tensor:
        """The fixed CFM start noise ``[1, n_mels, noise_frames]`` (standard normal)."""
        return self.decoder.rand_noise

    def _model_dtype(self) -> torch.dtype:
        return self.encoder_proj.weight.dtype

    def _model_device(self) -> torch.device:
        return self.encoder_proj.weight.device

    def _speaker_rows(self, embeddings: Tensor | Sequence[Tensor], b: int) -> Tensor:
        """``[B, spk_embed_dim]`` from a tensor of that shape or ``B`` tensors of ``spk_embed_dim`` values."""
        dim = self.cfg.spk_embed_dim
        rows = [embeddings] if isinstance(embeddings, Tensor) else list(embeddings)
        if not all(isinstance(r, Tensor) and r.dtype.is_floating_point for r in rows):
            raise ValueError("flow: embeddings must be floating-point tensors")
        emb = torch.cat([r.reshape(-1, dim) if r.numel() % dim == 0 else r.reshape(1, -1) for r in rows])
        if emb.shape != (b, dim) or (not isinstance(embeddings, Tensor) and len(rows) != b):
            raise ValueError(f"flow: embeddings must be {b} speaker vectors of {dim} values, "
                             f"got {[tuple(r.shape) for r in rows]}")
        return emb

    def prepare(self, tokens: Sequence[Tensor], prompt_tokens: Sequence[Tensor],
                prompt_feats: Sequence[Tensor], embeddings: Tensor | Sequence[Tensor],
                streaming: bool | Sequence[bool], finalize: bool | Sequence[bool]) -> FlowInputs:
        """Validate a batch and pad it into :class:`FlowInputs` (host work only: tensors stay on
        the device they came on); see :meth:`inference_batch` for arguments and errors."""
        b = len(tokens)
        if b == 0:
            raise ValueError("flow: empty batch")
        if len(prompt_tokens) != b or len(prompt_feats) != b:
            raise ValueError(
                f"flow: {b} token sequences but {len(prompt_tokens)} prompt_tokens and {len(prompt_feats)} prompt_feats"
            )
        streaming_f = _flags(streaming, b, "streaming")
        finalize_f = _flags(finalize, b, "finalize")
        ratio, la = self.token_mel_ratio, self.pre_lookahead_len
        emb = self._speaker_rows(embeddings, b)

        seqs, feats = [], []
        token_lengths, enc_lengths, mel_lengths, prompt_frames = [], [], [], []
        for i in range(b):
            tok = _as_1d(tokens[i], "token", i)
            ptok = _as_1d(prompt_tokens[i], "prompt_token", i)
            if ptok.device != tok.device:
                ptok = ptok.to(tok.device)
            feat = prompt_feats[i]
            if not isinstance(feat, Tensor):
                raise ValueError(f"flow: prompt_feat[{i}] must be a tensor")
            if feat.dim() == 3 and feat.size(0) == 1:
                feat = feat[0]
            if feat.dim() != 2 or feat.size(-1) != self.n_mels or not feat.dtype.is_floating_point:
                raise ValueError(
                    f"flow: prompt_feat[{i}] must be a float log-mel of shape [1, frames, {self.n_mels}], "
                    f"got {tuple(prompt_feats[i].shape)} {prompt_feats[i].dtype}"
                )
            total = ptok.numel() + tok.numel()
            enc_len = total if finalize_f[i] else total - la
            if enc_len < 1:
                raise ValueError(
                    f"flow: item {i} has {total} tokens (prompt included); "
                    + ("at least 1 is needed" if finalize_f[i] else f"a non-final chunk needs more than {la}")
                )
            frames = ratio * enc_len
            if feat.size(0) > frames:
                raise ValueError(f"flow: item {i} has {feat.size(0)} prompt mel frames but only {frames} frames in all")
            seq = torch.cat([ptok, tok])  # integer promotion (exact); no no-op .long() conversions
            seqs.append(seq if seq.dtype == torch.long else seq.long())
            feats.append(feat if feat.dtype == torch.float32 else feat.float())
            token_lengths.append(total)
            enc_lengths.append(enc_len)
            mel_lengths.append(frames)
            prompt_frames.append(feat.size(0))
        if max(mel_lengths) > self.rand_noise.size(-1):
            raise ValueError(
                f"flow: {max(mel_lengths)} mel frames exceed the fixed noise buffer of {self.rand_noise.size(-1)} frames"
            )
        return FlowInputs(
            ids=pad_sequence(seqs, batch_first=True, padding_value=0),
            lengths=torch.tensor([token_lengths, enc_lengths, mel_lengths], dtype=torch.long),
            streaming=torch.tensor(streaming_f, dtype=torch.bool),
            embeddings=emb.float(),
            feats=pad_sequence([f if f.device == feats[0].device else f.to(feats[0].device) for f in feats],
                               batch_first=True),
            mel_lengths=tuple(mel_lengths), prompt_frames=tuple(prompt_frames),
            max_encoder_len=max(enc_lengths),
        )

    def encode(self, ids: Tensor, lengths: Tensor, streaming: Tensor, embeddings: Tensor, feats: Tensor,
               max_encoder_len: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Device part of conditioning, free of host synchronisation (CUDA-graph capturable).

        Args (on the model's device): ``ids [B, L]`` int64, ``lengths [3, B]`` int64 (tokens,
        encoder positions, mel frames per item), ``streaming [B]`` bool, ``embeddings
        [B, spk_embed_dim]`` float, ``feats [B, F, n_mels]`` float prompt log-mel (zero-padded,
        ``F <= T``); ``max_encoder_len`` >= every item's encoder positions (larger values only
        add masked padding). ``T = token_mel_ratio * max_encoder_len``.

        Returns ``(encoder_out [B, T, D], mu [B, n_mels, T], spks [B, n_mels], cond [B, n_mels, T],
        mask [B, 1, T])`` in the model dtype.
        """
        device, dtype = ids.device, self._model_dtype()
        token_len, enc_len, mel_len = lengths.unbind(0)
        t = self.token_mel_ratio * max_encoder_len
        token_mask = torch.arange(ids.size(1), device=device).unsqueeze(0) < token_len.unsqueeze(1)
        x = self.input_embedding(ids.clamp(min=0)) * token_mask.unsqueeze(-1).to(dtype)
        if x.size(1) < max_encoder_len:  # the encoder reads max_encoder_len positions
            x = F.pad(x, (0, 0, 0, max_encoder_len - x.size(1)))
        h = self.encoder(x, token_len, enc_len, streaming, max_encoder_len)
        mask = (torch.arange(t, device=device).unsqueeze(0) < mel_len.unsqueeze(1)).unsqueeze(1).to(dtype)
        mu = self.encoder_proj(h).transpose(1, 2) * mask
        spks = self.spk_embed_affine_layer(F.normalize(embeddings.to(dtype), dim=1))
        cond = F.pad(feats.to(dtype), (0, 0, 0, t - feats.size(1))).transpose(1, 2)
        return h, mu, spks, cond, mask

    @torch.inference_mode()
    def condition(self, tokens: Sequence[Tensor], prompt_tokens: Sequence[Tensor],
                  prompt_feats: Sequence[Tensor], embeddings: Tensor | Sequence[Tensor],
                  streaming: bool | Sequence[bool], finalize: bool | Sequence[bool]) -> FlowConditioning:
        """Run everything before the ODE solver for a batch; see :meth:`inference_batch` for arguments."""
        return self.condition_inputs(self.prepare(tokens, prompt_tokens, prompt_feats, embeddings, streaming, finalize))

    @torch.inference_mode()
    def condition_inputs(self, inp: FlowInputs) -> FlowConditioning:
        """:meth:`encode` of a prepared batch (moved to the model's device without host waits)."""
        device = self._model_device()
        dev = [to_device(x, device) for x in (inp.ids, inp.lengths, inp.streaming, inp.embeddings, inp.feats)]
        h, mu, spks, cond, mask = self.encode(*dev, inp.max_encoder_len)
        return FlowConditioning(
            encoder_out=h, mu=mu, spks=spks, cond=cond, mask=mask, streaming=dev[2],
            mel_lengths=inp.mel_lengths, prompt_frames=inp.prompt_frames,
        )

    @torch.inference_mode()
    def solve(self, c: FlowConditioning, n_timesteps: int | None = None) -> Tensor:
        """Flow-matching ODE for a :class:`FlowConditioning`: ``[B, n_mels, T]`` float32 log-mel
        including prompt and padded frames."""
        return self.decoder.solve(c.mu, c.mask, c.spks, c.cond, c.streaming, n_timesteps)

    @torch.inference_mode()
    def inference_batch(self, tokens: Sequence[Tensor], prompt_tokens: Sequence[Tensor],
                        prompt_feats: Sequence[Tensor], embeddings: Tensor | Sequence[Tensor],
                        streaming: bool | Sequence[bool] = False, finalize: bool | Sequence[bool] = True,
                        n_timesteps: int | None = None,
                        caches: Sequence[FlowStreamCache | None] | None = None) -> list[Tensor]:
        """Several utterances in one forward pass (right-padded, per-item masks).

        Args:
            tokens: ``B`` integer tensors ``[1, N_b]`` (or ``[N_b]``): speech-token ids
                (25 tokens/s, ``< vocab_size``; negative ids are clamped to 0 as upstream).
            prompt_tokens: ``B`` integer tensors ``[1, P_b]`` / ``[P_b]``, possibly empty.
            prompt_feats: ``B`` float tensors ``[1, F_b, n_mels]`` / ``[F_b, n_mels]``:
                prompt log-mel (50 frames/s), normally ``F_b = token_mel_ratio * P_b``;
                possibly empty.
            embeddings: ``[B, spk_embed_dim]`` float tensor or ``B`` tensors
                ``[1, spk_embed_dim]``: speaker x-vectors (L2-normalised here).
            streaming: one bool for all items or one per item: chunk-causal attention in
                encoder and estimator (upstream ``streaming``).
            finalize: one bool or one per item; False marks a non-final streaming chunk
                whose last ``pre_lookahead_len`` tokens are look-ahead context only.
            n_timesteps: Euler steps (default ``CFMConfig.n_timesteps`` = 10).
            caches: optional per item :class:`FlowStreamCache` (or None): the stream's cache,
                read and extended by streaming items (see :meth:`_start_cached`); an item with a
                usable cache returns only its frames from the first uncached one (non-prompt
                frame ``max(0, cache.frames - F_b)`` as of the call's start), i.e. a suffix of
                the full result.

        Returns:
            ``B`` float32 tensors ``[1, n_mels, T_b]``: log-mel of the non-prompt frames,
            ``T_b = token_mel_ratio * (P_b + N_b - (0 if finalize_b else pre_lookahead_len)) - F_b``.
            Each equals :meth:`inference` on that item alone (up to float summation order).

        Raises:
            ValueError: inconsistent list lengths, wrong shapes/dtypes, too few tokens
                (none at all, or ``<= pre_lookahead_len`` in a non-final chunk), more prompt
                frames than frames in all, or more frames than the fixed noise buffer
                (``CFMConfig.noise_frames``, 300 s).
        """
        run = self.start(self.prepare(tokens, prompt_tokens, prompt_feats, embeddings, streaming, finalize),
                         n_timesteps, caches)
        while run.steps_left:
            run.step()
        return run.mels()

    @property
    def supports_stream_cache(self) -> bool:
        """Whether :class:`FlowStreamCache` can be used (a one-level causal U-Net estimator)."""
        return bool(getattr(self.decoder.estimator, "supports_stream_cache", False))

    def prompt_prefix_frames(self, prompt_tokens: int) -> int:
        """Mel frames of a streaming call whose estimator and encoder work depends on the prompt alone
        (the same for every stream of a voice, whatever its tokens): the complete static chunks of a
        call over the prompt's tokens only, ``chunk * floor(ratio * (P - pre_lookahead_len) / chunk)``
        (a frame in a complete chunk reads the tokens of its encoder chunk and their look-ahead, all in
        the prompt; its noise, ``cond``, ``spks`` and ``t`` are the voice's; docs/architecture.md
        "Flow stream cache"); 0 without chunk-causal streaming or stream caches."""
        chunk = self.decoder.estimator.cfg.static_chunk_size
        if chunk <= 0 or not self.supports_stream_cache:
            return 0
        frames = self.token_mel_ratio * (int(prompt_tokens) - self.pre_lookahead_len)
        return max(0, frames // chunk * chunk)

    @torch.inference_mode()
    def start(self, inputs: FlowInputs, n_timesteps: int | None = None,
              caches: Sequence[FlowStreamCache | None] | None = None) -> "FlowRun":
        """Issue the encoder and the solver's set-up for a prepared batch; the Euler steps are
        then issued one at a time with :meth:`FlowRun.step` (so a caller can keep the GPU's
        queue short and stay responsive: see :class:`~cosyserve.engine.token2wav.Token2Wav`).
        Uses the CUDA graphs of :attr:`graph` when set (CUDA, default number of steps) unless
        a stream cache is given (``caches``: per item a :class:`FlowStreamCache` or None; see
        :meth:`_start_cached`: eager)."""
        if caches is not None and len(caches) != inputs.ids.shape[0]:
            raise ValueError(f"flow: {len(caches)} stream caches for {inputs.ids.shape[0]} items")
        if caches is not None and any(c is not None for c in caches):
            if self.supports_stream_cache:
                return self._start_cached(inputs, n_timesteps, list(caches))
            for c in caches:  # a deeper U-Net: caching would not be exact
                if c is not None:
                    c.clear()
        default_steps = n_timesteps in (None, self.cfg.cfm.n_timesteps)
        if self.graph is not None and self._model_device().type == "cuda" and default_steps:
            run = self.graph.start(inputs)
            if run is not None:
                return run
        c = self.condition_inputs(inputs)
        state = self.decoder.begin(c.mu, c.mask, c.spks, c.cond, c.streaming, n_timesteps)
        return FlowRun(lambda: self.decoder.step(state), state, inputs)

    def _start_cached(self, inputs: FlowInputs, n_timesteps: int | None,
                      caches: list[FlowStreamCache | None]) -> "FlowRun":
        """:meth:`start` with stream caches (eager).

        Item ``b`` with a usable cache of ``s_b`` frames (streaming call, same stream: its ids
        extend the cached call's) runs the solver on frames ``[s_b, T_b)`` only: ``mu``/``cond``
        and the fixed noise are taken from frame ``s_b`` on, and every Euler step reads the cached
        keys/values and convolution contexts of frames ``< s_b``
        (:class:`~cosyserve.models.flow_estimator.StreamCachePlan`). After the last step the
        cache holds the frames of this call's complete static chunks (``T_b`` rounded down to
        ``static_chunk_size``, at most ``max_frames``). The encoder likewise computes only the
        positions from its cache's end (whole encoder chunks, at most the estimator's first frame;
        :meth:`~cosyserve.models.flow_encoder.UpsampleConformerEncoder.forward_stream`), so ``mu``
        exists from there on. A non-streaming item's cache is cleared
        (full attention: nothing is reusable) and the item runs whole, as do items without one.
        Items of different ``s_b`` share the batch (cached keys padded to the longest, masked).
        """
        est = self.decoder.estimator
        n = self.cfg.cfm.n_timesteps if n_timesteps is None else int(n_timesteps)
        chunk = est.cfg.static_chunk_size
        dtype, device = self._model_dtype(), self._model_device()
        streaming = [bool(x) for x in inputs.streaming.tolist()]
        token_len = inputs.lengths[0].tolist()
        ids_host = inputs.ids if inputs.ids.device.type == "cpu" else inputs.ids.cpu()
        enc_chunk = self.encoder.cfg.static_chunk_size
        ratio = self.encoder.cfg.upsample_stride
        enc_len = inputs.lengths[1].tolist()
        starts, commit, used = [], [], []
        e_starts, e_commit, e_used = [], [], []
        for b, cache in enumerate(caches):
            frames = inputs.mel_lengths[b]
            if cache is None or not streaming[b] or chunk <= 0:
                if cache is not None:
                    cache.clear()
                    cache.commit_limit = None
                starts.append(0)
                commit.append(0)
                used.append(None)
                e_starts.append(0)
                e_commit.append(0)
                e_used.append(None)
                continue
            ids = ids_host[b, :token_len[b]].clone()
            s = min(cache._usable(ids, inputs.prompt_frames[b], n, dtype), frames)
            full = (frames // chunk) * chunk
            if cache.max_frames is not None:
                full = min(full, (cache.max_frames // chunk) * chunk)
            if cache.commit_limit is not None:
                full = min(full, (cache.commit_limit // chunk) * chunk)
                cache.commit_limit = None
            cache.ids, cache.prompt_frames, cache.dtype = ids, inputs.prompt_frames[b], dtype
            starts.append(s)
            commit.append(max(full, s))
            used.append(cache.estimator)
            # the encoder's cache: whole encoder chunks, never past the estimator's first frame
            enc = cache.encoder
            if enc.tokens * ratio > s or enc.tokens > enc_len[b]:
                enc.clear()
            e_starts.append(enc.tokens)
            e_full = min(enc_len[b], commit[-1] // ratio)
            e_commit.append((e_full // enc_chunk) * enc_chunk if enc_chunk > 0 else 0)
            e_used.append(enc)
        b_n = len(caches)
        dev = [to_device(x, device) for x in (inputs.ids, inputs.lengths, inputs.embeddings, inputs.feats)]
        ids_d, lengths_d, emb_d, feats_d = dev
        token_mask = torch.arange(ids_d.size(1), device=device).unsqueeze(0) < lengths_d[0].unsqueeze(1)
        x = self.input_embedding(ids_d.clamp(min=0)) * token_mask.unsqueeze(-1).to(dtype)
        h = self.encoder.forward_stream(x, lengths_d[0], enc_len, streaming, e_starts, e_used, e_commit)
        mu_enc = self.encoder_proj(h).transpose(1, 2)  # [B, n_mels, ratio * T_enc_new], from frame ratio * e_starts
        spks = self.spk_embed_affine_layer(F.normalize(emb_d.to(dtype), dim=1))
        new = [f - s for f, s in zip(inputs.mel_lengths, starts)]
        t_new = max(new)
        mu = mu_enc.new_zeros(b_n, self.n_mels, t_new)
        cond = torch.zeros_like(mu)
        x0 = mu_enc.new_zeros(b_n, t_new, self.n_mels)
        noise = self.decoder.noise(max(inputs.mel_lengths), device, dtype)[0]  # [n_mels, T]
        # every item's frames [s_b, s_b + new_b), left-aligned, with one gather + one indexed copy per
        # tensor for the whole batch (host-int index lists, one transfer): mu from the encoder's first
        # computed frame ratio * e_starts[b], the prompt mel (cond) where s_b is inside the prompt, the noise
        rows = list(range(b_n))
        if sum(new) > 0:
            row, dst = segment_index(rows, new, [0] * b_n)
            src_mu = segment_index(rows, new, [s - ratio * e for s, e in zip(starts, e_starts)])[1]
            src_x0 = segment_index(rows, new, starts)[1]
            row, dst, src_mu, src_x0 = to_device(torch.stack([row, dst, src_mu, src_x0]), device).unbind(0)
            mu.transpose(1, 2).index_put_((row, dst), mu_enc.transpose(1, 2)[row, src_mu])
            x0.index_put_((row, dst), noise.transpose(0, 1).index_select(0, src_x0))
        n_cond = [max(0, min(m, p - s)) for s, m, p in zip(starts, new, inputs.prompt_frames)]
        if sum(n_cond) > 0:
            row, dst = segment_index(rows, n_cond, [0] * b_n)
            src = segment_index(rows, n_cond, starts)[1]
            row, dst, src = to_device(torch.stack([row, dst, src]), device).unbind(0)
            cond.transpose(1, 2).index_put_((row, dst), feats_d[row, src].to(dtype))
        mask = (torch.arange(t_new, device=device).unsqueeze(0)
                < to_device(torch.tensor(new), device).unsqueeze(1)).unsqueeze(1).to(dtype)
        plan = est.stream_plan(used, starts, new, commit, streaming, n, device, dtype)
        streaming_d = to_device(torch.tensor(streaming, dtype=torch.bool), device)
        state = self.decoder.begin(mu, mask, spks, cond, streaming_d, n, x0=x0, plan=plan)
        return FlowRun(lambda: self.decoder.step(state), state, inputs, starts)

    def begin_prefixed(self, ids: Tensor, lengths: Tensor, streaming: Tensor, embeddings: Tensor, feats: Tensor,
                       max_encoder_len: int, pool: PrefixPool, slots: Tensor, starts: Tensor, t_new: int,
                       n_timesteps: int | None = None) -> SolverState:
        """Device part of a prefixed solve (:mod:`~cosyserve.models.flow_prefix`), free of host
        synchronisation (CUDA-graph capturable): :meth:`encode` over every token (arguments as there), then
        the solver's set-up on each row's frames ``[starts[b], mel_len[b])`` left-aligned in ``t_new`` frames
        (``mu``, ``cond`` and the fixed noise gathered from frame ``starts[b]`` on) with a
        :class:`~cosyserve.models.flow_prefix.PrefixPlan` reading pool slot ``slots[b]`` where ``starts[b] >
        0``. ``slots``, ``starts``: int64 ``[B]`` on the device; ``t_new`` >= every row's ``mel_len - start``.
        Returns the :class:`SolverState` (``state.x`` holds frames ``starts[b]`` on)."""
        _, mu, spks, cond, _ = self.encode(ids, lengths, streaming, embeddings, feats, max_encoder_len)
        return self.begin_after_prefix(mu, spks, cond, lengths[2], streaming, pool, slots, starts, t_new, n_timesteps)

    def begin_after_prefix(self, mu: Tensor, spks: Tensor, cond: Tensor, mel_len: Tensor, streaming: Tensor,
                           pool: PrefixPool, slots: Tensor, starts: Tensor, t_new: int,
                           n_timesteps: int | None = None) -> SolverState:
        """The solver part of :meth:`begin_prefixed` (free of host synchronisation): from the conditioning of
        whole items — ``mu``, ``cond`` ``[B, n_mels, T]`` (frames past an item's ``mel_len`` may hold
        anything finite: they are only read where masked), ``spks [B, n_mels]``, ``mel_len`` int64 ``[B]``,
        ``streaming`` bool ``[B]`` — the set-up on frames ``[starts[b], mel_len[b])`` (arguments as there)."""
        dtype, device = mu.dtype, mu.device
        frames = mu.size(-1)
        new = mel_len - starts
        i = torch.arange(t_new, device=device).view(1, -1)
        at = (starts.view(-1, 1) + i).clamp(max=frames - 1)                        # [B, Tn] absolute frames
        valid = (i < new.view(-1, 1)).to(dtype).unsqueeze(1)                        # [B, 1, Tn]
        at_mels = at.unsqueeze(1).expand(-1, self.n_mels, -1)
        mu_new = mu.gather(2, at_mels) * valid
        cond_new = cond.gather(2, at_mels) * valid
        x0 = self.decoder.noise(frames, device, dtype)[0].t()[at]                   # [B, Tn, n_mels]
        plan = PrefixPlan.build(pool, slots, starts, new, streaming, t_new,
                                self.decoder.estimator.cfg.static_chunk_size, dtype)
        return self.decoder.begin(mu_new, valid, spks, cond_new, streaming, n_timesteps, x0=x0, plan=plan)

    @torch.inference_mode()
    def start_prefixed(self, inputs: FlowInputs, pool: PrefixPool, slots: Sequence[int], starts: Sequence[int],
                       n_timesteps: int | None = None) -> "FlowRun":
        """:meth:`start` for a batch whose non-final streaming items start from their voice's prompt prefix
        in ``pool`` (eager; :meth:`begin_prefixed`). Item ``b`` with ``starts[b] > 0`` solves only the frames
        after the prefix in slot ``slots[b]``: ``starts[b]`` must be that slot's frames, the item streaming
        and at least that long, and the slot must hold the prefix of the item's voice (its prompt tokens,
        prompt mel and speaker embedding: the caller's key; not checked here). Items with ``starts[b] = 0``
        run whole (``slots[b]`` is then not read). Returns a :class:`FlowRun` whose :meth:`FlowRun.mels`
        are those of :meth:`start`. Raises ValueError for inconsistent arguments."""
        b_n = inputs.ids.shape[0]
        if len(slots) != b_n or len(starts) != b_n:
            raise ValueError(f"flow: {len(slots)} prefix slots and {len(starts)} starts for {b_n} items")
        streaming = inputs.streaming.tolist()
        for b, (slot, s) in enumerate(zip(slots, starts)):
            if s == 0:
                continue
            if not 0 <= slot < pool.slots or pool.frames[slot] != s:
                raise ValueError(f"flow: item {b} starts at frame {s}, but prefix slot {slot} holds "
                                 f"{pool.frames[slot] if 0 <= slot < pool.slots else 'nothing'}")
            if not streaming[b] or inputs.mel_lengths[b] < s:
                raise ValueError(f"flow: item {b} cannot start from a prefix of {s} frames (streaming "
                                 f"{streaming[b]}, {inputs.mel_lengths[b]} frames)")
        slots = [int(x) if s else 0 for x, s in zip(slots, starts)]  # a row without prefix reads no slot
        starts = [int(s) for s in starts]
        device = self._model_device()
        graph = self.prefix_graph
        if (graph is not None and graph.prefix_pool is pool and device.type == "cuda"
                and n_timesteps in (None, self.cfg.cfm.n_timesteps)):
            run = graph.start(inputs, slots, starts)
            if run is not None:
                return run
        dev = [to_device(x, device) for x in (inputs.ids, inputs.lengths, inputs.streaming, inputs.embeddings,
                                              inputs.feats)]
        idx = to_device(torch.tensor([slots, starts]), device)
        t_new = max(m - s for m, s in zip(inputs.mel_lengths, starts))
        state = self.begin_prefixed(*dev, inputs.max_encoder_len, pool, idx[0], idx[1], t_new, n_timesteps)
        return FlowRun(lambda: self.decoder.step(state), state, inputs, starts)

    @torch.inference_mode()
    def inference(self, token: Tensor, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor,
                  streaming: bool, finalize: bool) -> Tensor:
        """One utterance, upstream ``CausalMaskedDiffWithXvec.inference`` semantics.

        Args:
            token: ``[1, N]`` int speech tokens (25/s).
            prompt_token: ``[1, P]`` int prompt speech tokens (``P`` may be 0).
            prompt_feat: ``[1, F, n_mels]`` float prompt log-mel (50 frames/s), normally
                ``F = token_mel_ratio * P``; ``[1, 0, n_mels]`` without prompt.
            embedding: ``[1, spk_embed_dim]`` float speaker x-vector (L2-normalised here).
            streaming: chunk-causal attention (encoder chunk ``static_chunk_size`` tokens,
                estimator chunk ``EstimatorConfig.static_chunk_size`` frames, from frame 0).
            finalize: False for a non-final streaming chunk: the last
                ``pre_lookahead_len`` tokens are look-ahead context only (no frames for them).

        Returns:
            ``[1, n_mels, T]`` float32 natural-log mel of the non-prompt frames,
            ``T = token_mel_ratio * (P + N - (0 if finalize else pre_lookahead_len)) - F``.

        Raises:
            ValueError: a batch dimension other than 1, or any condition listed in
                :meth:`inference_batch`.
        """
        for name, x in (("token", token), ("prompt_token", prompt_token), ("prompt_feat", prompt_feat),
                        ("embedding", embedding)):
            if not isinstance(x, Tensor) or x.dim() < 2 or x.size(0) != 1:
                shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"flow.inference: {name} must have batch dimension 1, got {shape}")
        return self.inference_batch([token], [prompt_token], [prompt_feat], embedding,
                                    [bool(streaming)], [bool(finalize)])[0]
