"""CosyVoice3 token2wav streaming: the chunk schedule, the flow-mel trim and the HiFT re-run.

Upstream: ``CosyVoice2Model.tts`` (the chunk loop, inherited) and ``CosyVoice3Model.token2wav``
(``cosyvoice/cli/model.py``, CosyVoice commit ace7c47). Pure state: :class:`CV3StreamState` is
immutable and the three functions below return new states, so an engine can keep one per request
and batch the model calls of several requests however it likes; :func:`token2wav_step` and
:func:`stream_token2wav` run the models for one request (tests, CLI).

Schedule (per request; upstream keeps ``token_hop_len`` on the *model* and never resets it
between requests — here it is per stream, starting at ``token_hop_len``):

* ``prompt_token_pad = ceil(P / hop0) * hop0 - P`` for ``P`` flow prompt tokens (``hop0`` = 25):
  the first chunk ends on a multiple of the DiT's chunk (50 frames) counted from the prompt start.
* A non-final chunk is due when ``n_tokens - token_offset >= hop + pre_lookahead_len`` with
  ``hop = token_hop_len (+ prompt_token_pad for the first chunk)``; it passes
  ``tokens[:token_offset + hop + pre_lookahead_len]`` to ``flow.inference(streaming=True,
  finalize=False)`` (the last 3 tokens are right context only), then ``token_offset += hop`` and
  ``token_hop_len = min(token_max_hop_len, token_hop_len * stream_scale_factor)``.
* When the LM has finished and no non-final chunk is due, the final chunk passes all tokens to
  ``flow.inference(streaming=False, finalize=True)``. A non-streaming request is just that call
  with ``token_offset = 0``.
* Every chunk: ``new_mel = flow_mel[:, :, token_mel_ratio * token_offset:]``; the accumulated mel
  (all frames so far) grows by ``new_mel``; HiFT runs over the *whole* accumulated mel
  (``finalize`` as the flow call) and the samples already emitted (``speech_offset``) are cut off;
  no cross-fade (unlike CosyVoice2).

HiFT window (``hift_window=True``, the default everywhere here): instead of that whole-mel re-run,
:meth:`~cosyserve.models.hift.CausalHiFTGenerator.inference_stream_batch` runs the causal HiFT over
the last ``f0_margin + trunk_margin`` (8 + 35 for the official model) already emitted frames plus
the new ones, with the excitation phase carried in the state (``hift_carry``): the same samples
(bit for bit on the reference stream, ~1e-7 on long streams, see tests/test_cv3_fast.py) at a
per-chunk cost that no longer grows with the stream. ``hift_window=False`` keeps the re-run (A/B).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .token2wav import Token2Wav, copy_to_pinned_host

__all__ = ["CV3StreamSchedule", "CV3StreamState", "CV3ChunkJob", "CV3ChunkTrace", "new_stream", "plan_chunk",
           "after_flow", "after_hift", "speed_mel", "token2wav_step", "CV3BatchItem", "token2wav_batch",
           "stream_token2wav", "hift_stage", "Cv3T2WState", "Cv3Token2WavBackend"]


@dataclass(frozen=True)
class CV3StreamSchedule:
    """Chunking constants of ``CosyVoice3Model`` (upstream literals; ``token_hop_len`` must match the
    DiT's ``static_chunk_size / token_mel_ratio``, the yaml's ``chunk_size``)."""

    token_hop_len: int = 25
    token_max_hop_len: int = 100
    stream_scale_factor: int = 2
    pre_lookahead_len: int = 3
    token_mel_ratio: int = 2

    def __post_init__(self):
        if self.token_hop_len < 1 or self.token_max_hop_len < self.token_hop_len or self.stream_scale_factor < 1:
            raise ValueError(f"invalid CosyVoice3 stream schedule {self}")


@dataclass(frozen=True)
class CV3StreamState:
    """One request's token2wav progress (immutable).

    ``token_offset``: speech tokens whose mel was already produced; ``hop_len``: the current
    ``token_hop_len``; ``prompt_token_pad``: extra tokens of the first chunk; ``mel``: the
    accumulated mel ``[1, n_mels, frames]`` (None before the first chunk); ``speech_offset``:
    samples already emitted; ``finished``: the final chunk was emitted; ``hift_carry``: the
    windowed HiFT's carried excitation phase
    (:class:`~cosyserve.models.hift.CausalHiFTCarry`, 72 bytes; None when not windowed or while
    the window starts at frame 0).
    """

    schedule: CV3StreamSchedule
    prompt_token_pad: int
    hop_len: int
    token_offset: int = 0
    mel: Tensor | None = None
    speech_offset: int = 0
    finished: bool = False
    hift_carry: object = None


@dataclass(frozen=True)
class CV3ChunkJob:
    """One token2wav call: ``tokens[:n_tokens]`` through the flow with ``streaming``/``finalize``,
    mel frames from ``token_mel_ratio * token_offset`` on are new; ``hop``: tokens this chunk
    advances ``token_offset`` by (0 for the final chunk)."""

    n_tokens: int
    token_offset: int
    streaming: bool
    finalize: bool
    hop: int


def new_stream(prompt_tokens: int, schedule: CV3StreamSchedule | None = None) -> CV3StreamState:
    """The state before the first chunk of a request with ``prompt_tokens`` flow prompt tokens."""
    s = schedule or CV3StreamSchedule()
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
    pad = int(math.ceil(prompt_tokens / s.token_hop_len) * s.token_hop_len - prompt_tokens)
    return CV3StreamState(schedule=s, prompt_token_pad=pad, hop_len=s.token_hop_len)


def plan_chunk(state: CV3StreamState, n_tokens: int, llm_done: bool, stream: bool = True) -> CV3ChunkJob | None:
    """The next call for a request that has ``n_tokens`` speech tokens so far, or None (wait for
    more tokens). ``stream=False``: only the final (offline) call, once ``llm_done``.
    Raises ValueError after the final chunk or if tokens disappeared."""
    if state.finished:
        raise ValueError("the stream already emitted its final chunk")
    if n_tokens < state.token_offset:
        raise ValueError(f"{n_tokens} tokens but {state.token_offset} were already synthesised")
    s = state.schedule
    if stream:
        hop = state.hop_len + (state.prompt_token_pad if state.token_offset == 0 else 0)
        if n_tokens - state.token_offset >= hop + s.pre_lookahead_len:
            return CV3ChunkJob(n_tokens=state.token_offset + hop + s.pre_lookahead_len,
                               token_offset=state.token_offset, streaming=True, finalize=False, hop=hop)
    if llm_done:
        if n_tokens == 0:
            raise ValueError("no speech tokens to synthesise")
        return CV3ChunkJob(n_tokens=n_tokens, token_offset=state.token_offset, streaming=False, finalize=True, hop=0)
    return None


def after_flow(state: CV3StreamState, job: CV3ChunkJob, flow_mel: Tensor,
               first: int = 0) -> tuple[Tensor, CV3StreamState]:
    """Trim the flow output of ``job`` (``[1, n_mels, frames]``, prompt frames already removed; with
    ``first`` > 0 it starts at that frame, as the cached flow returns it) to its new frames and
    append them to the accumulated mel. Returns ``(hift_mel, state)``: the whole accumulated mel,
    HiFT's input for this chunk, and the state holding it."""
    if flow_mel.dim() != 3 or flow_mel.shape[0] != 1:
        raise ValueError(f"flow_mel must be [1, n_mels, frames], got {tuple(flow_mel.shape)}")
    skip = job.token_offset * state.schedule.token_mel_ratio - first
    if skip < 0:
        raise ValueError(f"the flow output starts at frame {first}, after the chunk's first new frame")
    new = flow_mel[:, :, skip:]
    mel = new if state.mel is None else torch.cat([state.mel.to(new), new], dim=2)
    return mel, replace(state, mel=mel)


def after_hift(state: CV3StreamState, job: CV3ChunkJob, speech: Tensor, new_only: bool = False,
               carry=None) -> tuple[Tensor, CV3StreamState]:
    """``speech`` ``[1, samples]``: HiFT's output over the accumulated mel for ``job`` (or, with
    ``new_only``, only the samples not yet emitted, as the windowed HiFT returns them, with its
    next ``carry``). Returns the samples not yet emitted and the state advanced past ``job``
    (``token_offset += hop``, hop grown; or ``finished``)."""
    out = speech if new_only else speech[:, state.speech_offset:]
    s = state.schedule
    if job.finalize:
        return out, replace(state, speech_offset=state.speech_offset + out.shape[1], finished=True, hift_carry=None)
    return out, replace(
        state, speech_offset=state.speech_offset + out.shape[1], token_offset=state.token_offset + job.hop,
        hop_len=min(s.token_max_hop_len, state.hop_len * s.stream_scale_factor), hift_carry=carry,
    )


def hift_stage(hift, states: list[CV3StreamState], jobs: list[CV3ChunkJob], mels: list[Tensor],
               window: bool = True) -> list[tuple[Tensor, CV3StreamState]]:
    """The HiFT half of a chunk for several streams at once: ``mels`` their accumulated mels
    ``[1, n_mels, frames]`` (after :func:`after_flow`, tempo applied), ``states`` the states
    :func:`after_flow` returned. ``window``: the bounded-window HiFT with the carried phase
    (:meth:`~cosyserve.models.hift.CausalHiFTGenerator.inference_stream_batch`), else the whole-mel
    re-run (``inference_batch``) trimmed by ``speech_offset``. Returns per stream ``(new samples
    [1, n], advanced state)``; both ways give the same samples (see the module docstring)."""
    fin = [j.finalize for j in jobs]
    if window:
        outs, carries = hift.inference_stream_batch(mels, [st.speech_offset for st in states], fin,
                                                    [st.hift_carry for st in states])
        return [after_hift(st, j, o, new_only=True, carry=c) for st, j, o, c in zip(states, jobs, outs, carries)]
    raws, _ = hift.inference_batch(mels, fin)
    return [after_hift(st, j, r) for st, j, r in zip(states, jobs, raws)]


@dataclass
class CV3ChunkTrace:
    """What one :func:`token2wav_step` computed (for tests and debugging)."""

    job: CV3ChunkJob
    flow_mel: Tensor
    hift_mel: Tensor
    speech: Tensor


def speed_mel(mel: Tensor, job: CV3ChunkJob, speed: float) -> Tensor:
    """HiFT's input for a tempo change (upstream ``token2wav(speed=...)``): the mel ``[1, C, T]``
    linearly resampled to ``int(T / speed)`` frames. Only for a whole utterance in one call
    (``token_offset == 0`` and ``finalize``, upstream asserts the same): ValueError otherwise."""
    if speed == 1.0:
        return mel
    if job.token_offset != 0 or not job.finalize:
        raise ValueError("speed change is only supported without streaming (one final call)")
    if not speed > 0:
        raise ValueError(f"speed must be positive, got {speed}")
    return torch.nn.functional.interpolate(mel, size=max(1, int(mel.shape[2] / speed)), mode="linear")


def token2wav_step(flow, hift, state: CV3StreamState, job: CV3ChunkJob, tokens: Tensor, prompt_token: Tensor,
                   prompt_feat: Tensor, embedding: Tensor, speed: float = 1.0,
                   hift_window: bool = True) -> tuple[CV3ChunkTrace, CV3StreamState]:
    """Run one job for one request: ``flow`` a :class:`~cosyserve.models.cv3_flow.CV3FlowModel`,
    ``hift`` a :class:`~cosyserve.models.hift.CausalHiFTGenerator`; ``tokens [1, >= n_tokens]``,
    ``prompt_token [1, P]``, ``prompt_feat [1, F, n_mels]``, ``embedding [1, spk_embed_dim]``;
    ``speed``: tempo factor (:func:`speed_mel`, non-streaming only); ``hift_window``: see
    :func:`hift_stage`. Returns the chunk's trace (``speech [1, n]`` float32 at the HiFT's rate) and
    the new state."""
    flow_mel = flow.inference(tokens[:, :job.n_tokens], prompt_token, prompt_feat, embedding,
                              streaming=job.streaming, finalize=job.finalize)
    hift_mel, state = after_flow(state, job, flow_mel)
    hift_mel = speed_mel(hift_mel, job, speed)
    ((speech, state),) = hift_stage(hift, [state], [job], [hift_mel], hift_window)
    return CV3ChunkTrace(job=job, flow_mel=flow_mel, hift_mel=hift_mel, speech=speech), state


@dataclass(frozen=True)
class CV3BatchItem:
    """One request's share of :func:`token2wav_batch`: its state and due job, its speech tokens
    ``[1, >= job.n_tokens]``, flow prompt tokens ``[1, P]``, prompt mel ``[1, F, n_mels]``,
    speaker embedding ``[1, spk_embed_dim]`` and tempo ``speed`` (non-streaming only)."""

    state: CV3StreamState
    job: CV3ChunkJob
    tokens: Tensor
    prompt_token: Tensor
    prompt_feat: Tensor
    embedding: Tensor
    speed: float = 1.0


def token2wav_batch(flow, hift, items: list[CV3BatchItem],
                    hift_window: bool = True) -> list[tuple[CV3ChunkTrace, CV3StreamState]]:
    """:func:`token2wav_step` for several requests at once: one padded flow pass
    (``FlowModel.inference_batch``, per-item streaming/finalize) and one HiFT pass
    (``CausalHiFTGenerator.inference_batch``). Returns ``(trace, new_state)`` per item, equal to
    the single-request steps up to float rounding of differently shaped kernels (~1e-6).
    Raises ValueError as the single-request functions do."""
    if not items:
        return []
    mels = flow.inference_batch([it.tokens[:, :it.job.n_tokens] for it in items], [it.prompt_token for it in items],
                                [it.prompt_feat for it in items], torch.cat([it.embedding for it in items]),
                                [it.job.streaming for it in items], [it.job.finalize for it in items])
    hift_in, states = [], []
    for it, mel in zip(items, mels):
        m, st = after_flow(it.state, it.job, mel)
        hift_in.append(speed_mel(m, it.job, it.speed))
        states.append(st)
    done = hift_stage(hift, states, [it.job for it in items], hift_in, hift_window)
    return [(CV3ChunkTrace(job=it.job, flow_mel=mel, hift_mel=m, speech=speech), st)
            for it, mel, m, (speech, st) in zip(items, mels, hift_in, done)]


def stream_token2wav(flow, hift, tokens: Tensor, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor,
                     stream: bool = True, schedule: CV3StreamSchedule | None = None,
                     speed: float = 1.0, hift_window: bool = True) -> Iterator[CV3ChunkTrace]:
    """All chunks of a request whose speech tokens ``[1, N]`` are all known (upstream's
    ``tts(source_speech_token=..., stream=...)`` path), as :class:`CV3ChunkTrace` in order;
    ``speed`` only with ``stream=False`` (upstream ignores it when streaming; here that is a
    ValueError rather than a silent no-op)."""
    if stream and speed != 1.0:
        raise ValueError("speed change is only supported without streaming")
    state = new_stream(prompt_token.shape[1], schedule)
    n = tokens.shape[1]
    while not state.finished:
        job = plan_chunk(state, n, llm_done=True, stream=stream)
        trace, state = token2wav_step(flow, hift, state, job, tokens, prompt_token, prompt_feat, embedding, speed,
                                      hift_window)
        yield trace


# ---------------------------------------------------------------------------- the engine's backend


@dataclass(frozen=True)
class Cv3T2WState:
    """A CosyVoice3 stream's token2wav state as it rides in ``Token2WavJob.hift_state`` /
    ``Token2WavResult.hift_state``: ``stream`` is the :class:`CV3StreamState` (accumulated mel,
    samples already emitted), None before the first chunk and after the final one. Constructible
    without arguments (the engine resets a finished segment's state with ``type(state)()``)."""

    stream: CV3StreamState | None = None

    @property
    def empty(self) -> bool:
        return self.stream is None


@dataclass
class Cv3FlowCacheSlot:
    """A CosyVoice3 stream's per-stream DiT cache as the engine keeps it between chunks (the same
    place as CosyVoice2's :class:`~cosyserve.models.flow.FlowStreamCache`: ``SegmentState.flow_cache``
    -> ``Token2WavJob.flow_cache``; :meth:`Cv3Token2WavBackend.new_flow_cache`). ``cache``: the
    :class:`~cosyserve.models.cv3_flow.DiTStreamCache` after the last cached chunk (None before the
    first); ``off``: the stream outgrew the budget (``max_frames`` cached frames, prompt included, or
    the backend's ``flow_cache_max_bytes``) and recomputes its chunks from then on (sticky)."""

    max_frames: int | None = None
    cache: object = None
    off: bool = False


class Cv3Token2WavBackend(Token2Wav):
    """The engine's token2wav backend for CosyVoice3 (``make_token2wav`` picks it for a
    ``cosyvoice3.yaml`` model): same ``launch`` / ``finish`` / ``run`` / ``run_each`` interface as
    :class:`~cosyserve.engine.token2wav.Token2Wav`, whose batched flow pass it reuses
    (:class:`~cosyserve.models.cv3_flow.CV3FlowModel` through ``prepare``/``start``/``step``, issued a
    few Euler steps at a time on a CUDA side stream), with CosyVoice3's HiFT stage instead of
    CosyVoice2's cache + cross-fade:

    * each job is one ``CosyVoice3Model.token2wav`` call: ``job.tokens`` (``[N]``, all tokens so far
      incl. the 3 look-ahead tokens of a non-final chunk) through the flow with
      ``streaming``/``finalize`` as the job says (the engine's chunk schedule, upstream policy, is
      upstream's ``token_hop_len`` schedule: first hop 25 + prompt pad, doubling up to 100);
    * :func:`after_flow`: the mel frames from ``token_mel_ratio * job.token_offset`` on are appended
      to the stream's accumulated mel (:class:`Cv3T2WState` in ``job.hift_state``);
    * one HiFT batch (:func:`hift_stage`): by default the bounded window with the carried phase
      (``hift_window``), else the whole-mel re-run cut by :func:`after_hift`.

    ``speed`` applies to an offline job only (a whole utterance in one call, as upstream); a
    streamed segment ignores it like upstream's streaming path. Results: speech ``[n]`` float32 on
    the CPU and the next :class:`Cv3T2WState` (empty after the final chunk). The HiFT noise is fixed
    at construction, so the jobs' generators are not used. Raises ValueError (per job, through
    ``run_each``) on a state of another backend or a too short non-final chunk.
    """

    def __init__(self, flow, hift, token_mel_ratio: int, schedule: CV3StreamSchedule | None = None,
                 hift_window: bool = True):
        super().__init__(flow, hift, token_mel_ratio)
        pre = int(getattr(getattr(flow, "cfg", None), "pre_lookahead_len", 3))
        self.schedule = schedule or CV3StreamSchedule(pre_lookahead_len=pre, token_mel_ratio=token_mel_ratio)
        #: the bounded-window HiFT with the carried phase (:func:`hift_stage`); False: whole-mel re-run
        self.hift_window = hift_window
        #: a stream whose cache would exceed this drops it and recomputes its later chunks (1 GiB:
        #: ~580 frames = 11.6 s at full size in bf16, ~290 in float32)
        self.flow_cache_max_bytes = 1 << 30

    @property
    def supports_flow_cache(self) -> bool:
        """Whether streaming jobs may carry a :class:`Cv3FlowCacheSlot` (the CosyVoice3 DiT flow's
        :meth:`~cosyserve.models.cv3_flow.CV3FlowModel.stream_cached_batch`; 1.8 MB per cached frame
        at full size in bf16, dropped at the final chunk). The engine decides whether to use it
        (``EngineConfig.flow_stream_cache``; auto: on while the flow has no CUDA graphs — the cached
        chunk runs eagerly)."""
        return hasattr(self.flow, "stream_cached_batch")

    def new_flow_cache(self, max_frames: int | None = None) -> Cv3FlowCacheSlot:
        """An empty per-stream cache slot (``max_frames``: ``--flow-stream-cache-frames``)."""
        return Cv3FlowCacheSlot(max_frames)

    def flow_cache_bytes(self, flow_cache) -> int:
        """Device bytes a stream's :class:`Cv3FlowCacheSlot` holds now (0 without a cache)."""
        cache = getattr(flow_cache, "cache", None)
        return 0 if cache is None else int(cache.nbytes)

    def _unet_caches(self, jobs) -> list:
        """None for every job: the usual flow pass never uses a CosyVoice3 stream's cache (cached jobs
        go through :meth:`launch`'s cached batch)."""
        return [None] * len(jobs)

    @staticmethod
    def _flow_cache(job) -> Cv3FlowCacheSlot | None:
        slot = job.flow_cache
        return slot if isinstance(slot, Cv3FlowCacheSlot) and not slot.off else None

    def launch(self, jobs, stream=None, marks=None, queue_steps=None, queue_s=None):
        """As :meth:`Token2Wav.launch <cosyserve.engine.token2wav.Token2Wav.launch>`; with the flow
        stream cache on, the streaming non-final jobs run through
        :meth:`~cosyserve.models.cv3_flow.CV3FlowModel.stream_cached_batch` (one eager batch, issued
        here) and the others through the usual flow pass; HiFT then runs over all of them at once."""
        cached = [i for i, j in enumerate(jobs) if j.streaming and not j.finalize and self._flow_cache(j) is not None]
        if not cached:
            return super().launch(jobs, stream, marks, queue_steps, queue_s)
        from .token2wav import PendingToken2Wav

        pending = PendingToken2Wav(self, jobs, stream, marks)
        with pending.on_stream():
            if marks is not None:
                pending.stamps.append(marks.mark(stream))
            rest = [i for i in range(len(jobs)) if i not in cached]

            def prepare(idx):
                sel = [jobs[i] for i in idx]
                return self.flow.prepare([j.tokens[None] for j in sel], [j.voice.flow_speech_token[None] for j in sel],
                                         [j.voice.speech_feat[None] for j in sel],
                                         torch.stack([j.voice.flow_embedding for j in sel]),
                                         streaming=[j.streaming for j in sel], finalize=[j.finalize for j in sel])

            mels, firsts, caches = self.flow.stream_cached_batch(prepare(cached),
                                                                 [self._flow_cache(jobs[i]).cache for i in cached])
            pending.run = _SplitFlowRun(len(jobs), cached, mels, firsts, caches,
                                        self.flow.start(prepare(rest)) if rest else None, rest)
        pending.advance(queue_steps, queue_s)
        return pending

    def _state(self, job) -> CV3StreamState:
        st = job.hift_state
        if isinstance(st, Cv3T2WState) and st.stream is not None:
            return st.stream
        if getattr(st, "empty", False):  # not started (the engine's initial HiFTStreamState())
            return new_stream(int(job.voice.flow_speech_token.numel()), self.schedule)
        raise ValueError(f"a CosyVoice3 token2wav job needs a Cv3T2WState, got {type(st).__name__}")

    def _chunk_job(self, job) -> CV3ChunkJob:
        n = int(job.tokens.numel())
        hop = 0 if job.finalize else n - self.schedule.pre_lookahead_len - job.token_offset
        if not job.finalize and hop < 1:
            raise ValueError(f"a non-final CosyVoice3 chunk needs more than {self.schedule.pre_lookahead_len} "
                             f"tokens past token_offset {job.token_offset}, got {n}")
        return CV3ChunkJob(n_tokens=n, token_offset=int(job.token_offset), streaming=bool(job.streaming),
                           finalize=bool(job.finalize), hop=hop)

    def _issue_hift(self, p) -> None:
        """After the flow's last step: accumulate each job's new mel frames, one causal HiFT batch
        over the accumulated mels, cut what was already emitted (on ``p``'s stream; speech copied to
        pinned host buffers and an event recorded on CUDA)."""
        jobs, marks, stream = p.jobs, p.marks_src, p.stream
        mels = p.run.mels()
        firsts = getattr(p.run, "firsts", None) or [0] * len(jobs)
        flow_caches = list(getattr(p.run, "caches", None) or [None] * len(jobs))
        if marks is not None:
            p.stamps.append(marks.mark(stream))
        dev = self.hift_device
        hift_in, states, cjobs = [], [], []
        for j, mel, first in zip(jobs, mels, firsts):
            st, cj = self._state(j), self._chunk_job(j)
            m, st = after_flow(st, cj, mel.to(dev, torch.float32), first)
            if j.speed != 1.0 and cj.finalize and cj.token_offset == 0 and st.speech_offset == 0:
                m = speed_mel(m, cj, j.speed)
            hift_in.append(m)
            states.append(st)
            cjobs.append(cj)
        speech, new_states = [], []
        for j, fc in zip(jobs, flow_caches):  # the streams' slots take their new caches (one job per stream)
            slot = self._flow_cache(j)
            if slot is None or fc is None:
                continue
            if fc.nbytes > self.flow_cache_max_bytes or (slot.max_frames is not None and fc.frames > slot.max_frames):
                slot.cache, slot.off = None, True  # sticky: the stream outgrew the budget, recomputes from now
            else:
                slot.cache = fc
        for out, st in hift_stage(self.hift, states, cjobs, hift_in, self.hift_window):
            speech.append(out[0].float())
            new_states.append(Cv3T2WState() if st.finished else Cv3T2WState(st))
        if marks is not None:
            p.stamps.append(marks.mark(stream))
        if stream is not None:
            speech, p.event = copy_to_pinned_host(speech, stream)
        p.speech, p.states = speech, new_states
        p.keep = (mels, hift_in)


class _SplitFlowRun:
    """A flow batch of :meth:`Cv3Token2WavBackend.launch` with the flow stream cache on: the
    cached jobs' mels (already computed, each starting at frame ``firsts[i]``) and a
    :class:`~cosyserve.models.flow.FlowRun` of the other jobs (or None), stepped as one run;
    :meth:`mels`, :attr:`firsts` and :attr:`caches` (the new stream caches; None for uncached jobs)
    in job order."""

    def __init__(self, n: int, cached: list[int], mels: list, firsts: list[int], caches: list, run, rest: list[int]):
        self._run, self._rest = run, rest
        self._mels: list = [None] * n
        self.firsts = [0] * n
        self.caches: list = [None] * n
        for i, m, f, c in zip(cached, mels, firsts, caches):
            self._mels[i], self.firsts[i], self.caches[i] = m, f, c

    @property
    def steps_left(self) -> int:
        return self._run.steps_left if self._run is not None else 0

    @property
    def cost_key(self):
        """The uncached jobs' :attr:`FlowRun.cost_key <cosyserve.models.flow.FlowRun.cost_key>` (None without)."""
        return self._run.cost_key if self._run is not None else None

    def step(self) -> None:
        self._run.step()

    def mels(self) -> list:
        out = list(self._mels)
        if self._run is not None:
            for i, m in zip(self._rest, self._run.mels()):
                out[i] = m
        return out
