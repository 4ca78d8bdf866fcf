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
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import InvalidInputError
from ..frontend.voice import Voice
from ..models.hift import HiFTStreamState
from ..models.sampling import UpstreamSampler
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
    """

    seed: int | None = None
    stream: bool = True
    chunk_policy: ChunkPolicy = field(default_factory=ChunkPolicy)
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0
    speed: float = 1.0
    timeout_s: float | None = None

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
    ``n_tokens``: speech tokens it covers (25/s); ``final``: last chunk of the request.
    """

    request_id: str
    index: int
    segment: int
    samples: np.ndarray
    sample_rate: int
    n_tokens: int
    final: bool = False

    @property
    def duration_s(self) -> float:
        return self.samples.shape[0] / self.sample_rate


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
    prefilled: bool = False
    lm_done: bool = False
    t2w_done: bool = False
    hift_gen: torch.Generator | None = None
    hift_state: HiFTStreamState = field(default_factory=HiFTStreamState)
    emitted_tokens: int = 0


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
        for i, ids in enumerate(req.segments):
            n = int(ids.numel())
            st.segments.append(SegmentState(
                index=i, text_ids=ids.reshape(-1).to(torch.long),
                min_len=int(n * p.min_token_text_ratio), max_len=max(1, int(n * p.max_token_text_ratio)),
                lm_gen=lm_gen, sampler=sampler_factory(), stream=p.stream,
                schedule=p.chunk_policy.start(n_prompt) if p.stream else None,
            ))
        if p.timeout_s is not None:
            st.deadline = req.arrival + p.timeout_s
        return st

    def next_lm_segment(self) -> SegmentState | None:
        """The segment whose LM should run next, if its predecessor's LM has finished."""
        if self.lm_segment >= len(self.segments):
            return None
        return self.segments[self.lm_segment]

    def hift_generator(self, seg: SegmentState) -> torch.Generator:
        """HiFT's random source for a segment.

        Offline: a copy of the LM generator taken when the segment's LM finished, so the
        random draws follow upstream's single global generator (LM first, then HiFT) and a
        seeded single-segment request reproduces upstream exactly. Streaming: a generator
        derived from the seed, independent of LM timing, so streaming and offline runs of
        one seed sample the same tokens.
        """
        if seg.hift_gen is None:
            g = torch.Generator()
            if seg.stream:
                g.manual_seed((self.seed ^ HIFT_SEED_SALT) + seg.index)
            else:
                g.set_state(seg.lm_gen.get_state())
            seg.hift_gen = g
        return seg.hift_gen
