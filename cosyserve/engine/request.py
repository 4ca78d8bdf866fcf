"""Requests, their per-request runtime state, and what the engine emits.

Everything a request needs lives in its own state objects (no dicts keyed by request id
on a shared model, no state on model objects): :class:`RequestState` holds the inputs
and one :class:`SegmentState` per text segment (LM slot, generated tokens, random
generators, chunk schedule, HiFT stream cache).
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import InvalidInputError
from ..frontend.voice import Voice
from ..models.hift import HiFTStreamState
from ..models.sampling import UpstreamSampler
from .admission import chunk_speedup
from .chunking import ChunkPolicy, ChunkSchedule

HIFT_SEED_SALT = 0x5EED_C0DE


@dataclass(frozen=True)
class SynthesisParams:
    """Per-request options.

    ``seed``: makes the request reproducible (``None``: a random seed, reported back).
    ``stream``: emit audio chunk by chunk while the LM generates (else one waveform per
    text segment). ``chunk_policy``: see :mod:`cosyserve.engine.chunking`.
    ``min_token_text_ratio`` / ``max_token_text_ratio``: speech tokens per text token that
    the LM must / may generate (upstream 2 and 20); useful to pin the output length of
    untrained weights. ``speed``: tempo factor (0.5-2.0; mel time-stretch as upstream).
    ``timeout_s``: abort the request after this many seconds.

    LM-only requests (``lm_only=True``, the native OpenAI completions endpoint and
    ``cosyserve batch``): only the speech LM runs, no audio is made; the request's
    :class:`RequestFinished` carries the generated tokens of each segment. ``min_tokens`` /
    ``max_tokens`` (speech tokens per segment) then replace the ratio-derived bounds when
    given, and ``sampler_factory`` (a zero-argument callable returning an object with
    :class:`~cosyserve.models.sampling.UpstreamSampler`'s ``sample`` method) replaces the
    model's RAS sampler. They work for audio requests too.
    """

    seed: int | None = None
    stream: bool = True
    chunk_policy: ChunkPolicy = field(default_factory=ChunkPolicy)
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0
    speed: float = 1.0
    timeout_s: float | None = None
    lm_only: bool = False
    min_tokens: int | None = None
    max_tokens: int | None = None
    sampler_factory: Callable[[], object] | None = field(default=None, compare=False, repr=False)

    def validate(self) -> None:
        if not (0.0 <= self.min_token_text_ratio <= self.max_token_text_ratio):
            raise InvalidInputError("min_token_text_ratio must be >= 0 and <= max_token_text_ratio",
                                    field="min_token_text_ratio")
        if not (0 < self.max_token_text_ratio <= 100):
            raise InvalidInputError("max_token_text_ratio must be in (0, 100]", field="max_token_text_ratio")
        if not (0.25 <= self.speed <= 4.0):
            raise InvalidInputError("speed must be between 0.25 and 4.0", field="speed")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise InvalidInputError("timeout must be positive", field="timeout")
        if self.min_tokens is not None and self.min_tokens < 0:
            raise InvalidInputError("min_tokens must be >= 0", field="min_tokens")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidInputError("max_tokens must be >= 1", field="max_tokens")
        if self.min_tokens is not None and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidInputError("min_tokens must not exceed max_tokens", field="min_tokens")

    @property
    def streams_audio(self) -> bool:
        """Audio goes out chunk by chunk with playback deadlines (``stream`` and not ``lm_only``)."""
        return self.stream and not self.lm_only

    def token_bounds(self, n_text_tokens: int) -> tuple[int, int]:
        """``(min_len, max_len)`` speech tokens for a segment of ``n_text_tokens`` text tokens
        (explicit ``min_tokens``/``max_tokens`` win over the ratios, as upstream's ``int(n * ratio)``)."""
        lo = self.min_tokens if self.min_tokens is not None else int(n_text_tokens * self.min_token_text_ratio)
        hi = self.max_tokens if self.max_tokens is not None else max(1, int(n_text_tokens * self.max_token_text_ratio))
        return lo, max(hi, 1)


@dataclass
class EngineRequest:
    """A synthesis job as the engine sees it: token ids, a voice, options.

    ``segments``: text-token ids (1-D int tensors) of each normalised text segment, spoken
    in order. ``voice``: the zero-shot prompt.
    """

    request_id: str
    segments: list[torch.Tensor]
    voice: Voice
    params: SynthesisParams = field(default_factory=SynthesisParams)
    arrival: float = field(default_factory=time.monotonic)

    def __post_init__(self):
        if not self.segments or any(s.numel() == 0 for s in self.segments):
            raise InvalidInputError("nothing to synthesize: the text is empty", field="input")
        self.params.validate()


@dataclass
class AudioChunk:
    """A piece of the output waveform (mono float32 at ``sample_rate``).

    ``index``: chunk number within the request; ``segment``: text segment it belongs to;
    ``n_tokens``: speech tokens it covers (25/s); ``final``: last chunk of the request;
    ``emitted_at``: ``time.monotonic()`` when the engine handed it out; ``slack_s``: seconds left
    then before its playback deadline (the audio before it played from the first chunk's emission
    on; None for a first chunk and for offline requests). A server compares them with when it sends
    the chunk (:meth:`cosyserve.engine.core.EngineCore.observe_delivered_slack`).
    """

    request_id: str
    index: int
    segment: int
    samples: np.ndarray
    sample_rate: int
    n_tokens: int
    final: bool = False
    emitted_at: float | None = None
    slack_s: float | None = None

    @property
    def duration_s(self) -> float:
        return self.samples.shape[0] / self.sample_rate


@dataclass
class TokensGenerated:
    """New speech tokens of a streaming LM-only request (``SynthesisParams(lm_only=True,
    stream=True)``: the completions endpoint's ``stream: true``), emitted by the step that
    produced them: ``tokens`` (speech token ids, stop tokens excluded) of segment ``segment``."""

    request_id: str
    segment: int
    tokens: list[int]


class Outcome(enum.Enum):
    OK = "ok"
    ABORTED = "aborted"
    TIMEOUT = "timeout"
    ERROR = "error"


@dataclass
class RequestFinished:
    """Emitted once per request after its last chunk (or instead of it, on failure)."""

    request_id: str
    outcome: Outcome
    error: Exception | None = None
    n_tokens: int = 0
    audio_s: float = 0.0
    first_chunk_s: float | None = None
    total_s: float = 0.0
    seed: int = 0
    tokens: list[list[int]] = field(default_factory=list)
    #: per segment: ``"stop"`` (a stop token was sampled), ``"length"`` (max length reached),
    #: ``None`` (the LM did not finish that segment)
    stop_reasons: list[str | None] = field(default_factory=list)
    #: where the first-chunk latency went (seconds, host clock; they add up to ``first_chunk_s``):
    #: ``queue`` arrival -> its prefill began (waiting for a slot / the prefill budget),
    #: ``prefill`` -> first speech token sampled, ``decode`` -> the first chunk's tokens were all
    #: there, ``t2w_wait`` -> its token2wav batch was launched (waiting for the GPU's previous
    #: batch), ``token2wav`` -> the chunk was emitted (flow + HiFT + copy). None without a chunk.
    first_chunk_breakdown: dict[str, float] | None = None


@dataclass
class SegmentState:
    """Runtime state of one text segment of a request (LM generation + token2wav)."""

    index: int
    text_ids: torch.Tensor
    min_len: int
    max_len: int
    lm_gen: torch.Generator
    sampler: UpstreamSampler
    stream: bool
    schedule: ChunkSchedule | None
    tokens: list[int] = field(default_factory=list)
    slot: int | None = None
    length: int = 0          # positions of this segment held in its KV slot
    issued: int = 0          # tokens sampled or being sampled on the GPU (>= len(tokens))
    prefilled: bool = False
    lm_done: bool = False
    t2w_done: bool = False
    hift_gen: torch.Generator | None = None
    hift_state: HiFTStreamState = field(default_factory=HiFTStreamState)
    emitted_tokens: int = 0
    #: the tokens token2wav reads: ``tokens`` after upstream ``llm_job``'s silent-token rule
    #: (``silent``, a :class:`~cosyserve.models.llm.SilentTokenFilter`; every token for CosyVoice2).
    #: ``tokens`` (LM history, ``max_len``, ``RequestFinished.tokens``) keeps the raw list.
    t2w_tokens: list[int] = field(default_factory=list)
    silent: object | None = None
    stop_reason: str | None = None  # "stop" / "length" once the LM has finished
    #: the stream's :class:`~cosyserve.models.flow.FlowStreamCache` (issue 17) while it streams
    flow_cache: object | None = None


@dataclass
class RequestState:
    """Runtime state of a request inside the engine."""

    req: EngineRequest
    seed: int
    segments: list[SegmentState] = field(default_factory=list)
    lm_segment: int = 0       # next segment whose LM has not started/finished
    out_segment: int = 0      # segment whose audio is being emitted
    chunks: int = 0
    audio_samples: int = 0
    first_chunk_at: float | None = None
    aborted: Outcome | None = None
    deadline: float | None = None
    # first-chunk milestones (time.monotonic), see RequestFinished.first_chunk_breakdown
    t_prefill: float | None = None
    t_first_token: float | None = None
    t_ready: float | None = None
    t_launch: float | None = None
    #: how much faster than real time its chunk schedule must be computed while it starts
    #: (:func:`~cosyserve.engine.admission.chunk_speedup`; 1 offline): admission's ``S``
    speedup: float = 1.0
    #: speech tokens of its first segment's first hop (0 offline): the first chunk's playback
    first_hop_tokens: int = 0

    def first_chunk_breakdown(self) -> dict[str, float] | None:
        """The first-chunk latency split into scheduler phases (None before the first chunk)."""
        if self.first_chunk_at is None:
            return None
        marks = [("queue", self.t_prefill), ("prefill", self.t_first_token), ("decode", self.t_ready),
                 ("t2w_wait", self.t_launch), ("token2wav", self.first_chunk_at)]
        out, prev = {}, self.req.arrival
        for name, t in marks:
            t = prev if t is None else max(t, prev)
            out[name] = t - prev
            prev = t
        return out

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @classmethod
    def create(cls, req: EngineRequest, speech_token_size: int, sampler_factory) -> "RequestState":
        p = req.params
        seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(4), "little")
        lm_gen = torch.Generator().manual_seed(seed)
        st = cls(req=req, seed=seed)
        n_prompt = int(req.voice.flow_speech_token.numel())
        make_sampler = p.sampler_factory or sampler_factory
        for i, ids in enumerate(req.segments):
            lo, hi = p.token_bounds(int(ids.numel()))
            stream = p.streams_audio
            st.segments.append(SegmentState(
                index=i, text_ids=ids.reshape(-1).to(torch.long), min_len=lo, max_len=hi,
                lm_gen=lm_gen, sampler=make_sampler(), stream=stream,
                schedule=p.chunk_policy.start(n_prompt) if stream else None,
            ))
        if p.timeout_s is not None:
            st.deadline = req.arrival + p.timeout_s
        if p.streams_audio:
            st.speedup = chunk_speedup(p.chunk_policy)
            if st.segments and st.segments[0].schedule is not None:  # (the first segment's schedule)
                st.first_hop_tokens = int(st.segments[0].schedule.hop)
        return st

    def next_lm_segment(self) -> SegmentState | None:
        """The segment whose LM should run next, if its predecessor's LM has finished."""
        if self.lm_segment >= len(self.segments):
            return None
        return self.segments[self.lm_segment]

    def hift_generator(self, seg: SegmentState, device: torch.device | str = "cpu") -> torch.Generator:
        """HiFT's random source for a segment, on ``device`` (where HiFT runs).

        Offline: a copy of the LM generator taken when the segment's LM finished, so the
        random draws follow upstream's single global generator (LM first, then HiFT) and a
        seeded single-segment request reproduces upstream exactly. Streaming: a generator
        derived from the seed, independent of LM timing, so streaming and offline runs of
        one seed sample the same tokens.

        On a CUDA ``device`` the generator is a CUDA (Philox) generator, so the excitation
        noise (hundreds of thousands of normals per chunk) is drawn on the GPU without host
        work or synchronisation: seeded like the streaming CPU generator, or, offline, with a
        seed drawn from the copy of the LM generator. Seeded runs stay reproducible on one
        device; the audio of a seed differs between CPU and GPU (as upstream's does, whose
        GPU draws come from the CUDA generator).
        """
        if seg.hift_gen is None:
            device = torch.device(device)
            if seg.stream:
                g = torch.Generator(device=device).manual_seed((self.seed ^ HIFT_SEED_SALT) + seg.index)
            else:
                g = torch.Generator()
                g.set_state(seg.lm_gen.get_state())
                if device.type != "cpu":
                    g = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**62, (1,), generator=g)))
            seg.hift_gen = g
        return seg.hift_gen
