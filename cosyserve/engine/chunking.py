"""When a stream emits audio: chunk schedules for streaming token2wav.

A streaming request turns speech tokens into audio chunk by chunk while the LM is still
generating. Each non-final chunk covers ``hop`` new tokens and needs ``lookahead`` more
(the flow's pre-look-ahead convolution, 3 tokens) before it can be computed; the final
chunk covers everything left once the LM has finished. The schedule decides the hops.

Policies (all per request: the state lives in :class:`ChunkSchedule`, never on a shared
model object as upstream does with ``token_hop_len``):

* ``upstream`` (default) — CosyVoice2's ``CosyVoice2Model.tts``: the first hop is
  ``base`` (25, the flow's training chunk) plus the padding that aligns prompt + first
  chunk to a multiple of 25 tokens, later hops double up to ``max_hop`` (100).
* ``fixed`` — every hop is ``base`` tokens (the "equal" strategy of the Triton
  runtime's ``streaming_inference.py``).
* ``exponential`` — the Triton runtime's ``cosyvoice2`` model: the first hop is
  ``first`` (15) tokens, the k-th later hop ``base * 2**k`` (25, 50, 100, ...), capped at
  ``max_hop`` when one is given.

The chunk boundaries depend only on the token count, never on timing, so a stream is
reproducible: given all tokens, the streamed chunks are exactly those of upstream.

The Step-Audio2 DiT token2wav path (``--token2wav-dir``) defaults to :data:`DIT_CHUNK_POLICY`
(``exponential:15:25:25``: a 15-token first hop, then fixed 25-token hops, Step-Audio2's own chunk
size): its per-stream caches make every chunk cost its new frames only, and fixed hops keep the
CUDA-graph buckets a stream uses few and known before serving
(:meth:`ChunkPolicy.hops`, :func:`cosyserve.models.dit_flow.stream_solve_shapes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


#: the default chunk policy with a Step-Audio2 DiT token2wav directory (``--token2wav-dir``): first
#: hop 15 tokens (an early first chunk), then 25-token hops (Step-Audio2's chunk), 3 look-ahead tokens
DIT_CHUNK_POLICY = "exponential:15:25:25"
#: the default chunk policy otherwise (CosyVoice2's schedule)
DEFAULT_CHUNK_POLICY = "upstream"


def default_chunk_policy(dit: bool) -> str:
    """The chunk policy spec used when none is given: :data:`DIT_CHUNK_POLICY` for the DiT
    token2wav path (``dit``), else :data:`DEFAULT_CHUNK_POLICY`."""
    return DIT_CHUNK_POLICY if dit else DEFAULT_CHUNK_POLICY


@dataclass(frozen=True)
class ChunkPolicy:
    """Parameters of a chunk schedule (see module docstring). Units: speech tokens (25/s)."""

    kind: str = "upstream"
    base: int = 25
    first: int = 15
    max_hop: int | None = 100
    scale: int = 2
    lookahead: int = 3

    def __post_init__(self):
        if self.kind not in ("upstream", "fixed", "exponential"):
            raise ValueError(f"unknown chunk policy {self.kind!r} (upstream, fixed, exponential)")
        if self.base < 1 or self.first < 1 or self.scale < 1 or self.lookahead < 0:
            raise ValueError("chunk policy sizes must be positive")
        if self.max_hop is not None and self.max_hop < 1:
            raise ValueError("max_hop must be positive")

    @classmethod
    def parse(cls, spec: str, lookahead: int = 3) -> "ChunkPolicy":
        """``upstream``, ``upstream:25:100``, ``fixed:15``, ``exponential``, ``exponential:15:25[:max]``."""
        parts = spec.strip().split(":")
        kind, nums = parts[0], [int(p) for p in parts[1:] if p]
        if kind == "upstream":
            base, max_hop = (nums + [25, 100][len(nums):])[:2]
            return cls("upstream", base=base, max_hop=max_hop, lookahead=lookahead)
        if kind == "fixed":
            return cls("fixed", base=nums[0] if nums else 25, max_hop=None, lookahead=lookahead)
        if kind == "exponential":
            first = nums[0] if nums else 15
            base = nums[1] if len(nums) > 1 else 25
            max_hop = nums[2] if len(nums) > 2 else None
            return cls("exponential", base=base, first=first, max_hop=max_hop, lookahead=lookahead)
        raise ValueError(f"unknown chunk policy {spec!r} (upstream[:base:max], fixed[:hop], exponential[:first:base:max])")

    def start(self, n_prompt_tokens: int) -> "ChunkSchedule":
        """A fresh schedule for one utterance whose flow prompt has ``n_prompt_tokens`` tokens."""
        return ChunkSchedule(self, n_prompt_tokens)

    def hops(self, n_prompt_tokens: int, max_tokens: int) -> list[int]:
        """The non-final hops (tokens) of an utterance of at most ``max_tokens`` speech tokens after a
        flow prompt of ``n_prompt_tokens``, in order: every non-final chunk such a stream can make
        (each needs ``hop + lookahead`` tokens past its offset)."""
        s, out = self.start(n_prompt_tokens), []
        while s.chunk_end() <= max_tokens:
            out.append(s.hop)
            s.advance()
        return out


@dataclass
class ChunkSchedule:
    """Per-utterance chunk state: which tokens the next chunk covers and when it is ready."""

    policy: ChunkPolicy
    n_prompt_tokens: int
    token_offset: int = 0
    index: int = 0
    _hop: int = field(init=False)

    def __post_init__(self):
        p = self.policy
        if p.kind == "upstream":
            pad = math.ceil(self.n_prompt_tokens / p.base) * p.base - self.n_prompt_tokens
            self._hop = p.base + pad
        elif p.kind == "fixed":
            self._hop = p.base
        else:
            self._hop = p.first

    @property
    def hop(self) -> int:
        """New tokens the next non-final chunk will cover."""
        return self._hop

    def ready(self, n_tokens: int) -> bool:
        """Can a non-final chunk be made from ``n_tokens`` generated tokens?"""
        return n_tokens - self.token_offset >= self._hop + self.policy.lookahead

    def chunk_end(self) -> int:
        """Tokens ``[:chunk_end()]`` are passed to the flow for the next non-final chunk."""
        return self.token_offset + self._hop + self.policy.lookahead

    def advance(self) -> None:
        """Record that the next non-final chunk was made; compute the following hop."""
        p = self.policy
        self.token_offset += self._hop
        self.index += 1
        if p.kind == "upstream":
            base_hop = p.base * p.scale ** self.index
        elif p.kind == "fixed":
            base_hop = p.base
        else:
            base_hop = p.base * p.scale ** (self.index - 1)
        self._hop = min(base_hop, p.max_hop) if p.max_hop is not None else base_hop
