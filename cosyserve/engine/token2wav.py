"""token2wav: speech tokens -> waveform chunks, batched across streams.

One :class:`Token2WavJob` is one call of upstream ``CosyVoice2Model.token2wav``: the flow
turns ``[prompt tokens, tokens[:end]]`` into mel (chunk-causal attention for non-final
streaming chunks, look-ahead tokens excluded), the frames before ``token_offset`` are
dropped, and HiFT turns the rest into audio with the stream's cache (8-frame mel
overlap, 3840-sample excitation and speech overlap with a Hamming cross-fade). Jobs of
different streams that are ready at the same time run as ONE flow batch and ONE HiFT
batch; each keeps its own caches and random generator, and its result equals what it
would be alone (see the batching tests).

The first chunk of a stream therefore costs one flow solve over prompt + first chunk,
later chunks recompute the flow over everything so far (as upstream: the chunk-causal
attention makes earlier frames unchanged, and the look-ahead tokens of the last chunk are
refined when more tokens arrive).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..frontend.voice import Voice
from ..models.hift import HiFTGenerator, HiFTStreamState, hift_stream_step_batch


@dataclass
class Token2WavJob:
    """One token2wav call.

    ``tokens``: int tensor ``[N]`` of speech tokens passed to the flow (all tokens so far,
    up to and including the look-ahead for non-final chunks). ``token_offset``: tokens
    already turned into audio by earlier chunks. ``finalize``: last chunk of the segment
    (no look-ahead exclusion, no held-back tail). ``streaming``: chunk-causal flow
    attention (upstream passes ``stream`` for non-final chunks only).
    """

    voice: Voice
    tokens: torch.Tensor
    token_offset: int
    finalize: bool
    streaming: bool
    hift_state: HiFTStreamState
    generator: torch.Generator | None
    speed: float = 1.0


@dataclass
class Token2WavResult:
    speech: torch.Tensor          # [N] float32 on CPU
    hift_state: HiFTStreamState   # state for the next chunk (empty after a final chunk)


class Token2Wav:
    """Batched flow + HiFT over :class:`Token2WavJob`s.

    ``flow`` runs in its own dtype on its device; HiFT runs in float32. ``token_mel_ratio``
    comes from the model configuration.
    """

    def __init__(self, flow, hift: HiFTGenerator, token_mel_ratio: int):
        self.flow = flow
        self.hift = hift
        self.ratio = token_mel_ratio

    @property
    def device(self) -> torch.device:
        return next(self.flow.parameters()).device

    @torch.inference_mode()
    def run(self, jobs: list[Token2WavJob]) -> list[Token2WavResult]:
        """Run ``jobs`` as one flow batch and one HiFT batch; results in job order (blocking)."""
        return self.finish(self.launch(jobs, stream=None))

    @torch.inference_mode()
    def launch(self, jobs: list[Token2WavJob], stream=None, marks=None) -> "PendingToken2Wav":
        """Enqueue ``jobs`` without waiting for the GPU.

        With a CUDA ``stream``, all work is issued on it (inputs are created there too, so
        the caching allocator never hands their memory to another stream early) and an
        event marks completion; :meth:`PendingToken2Wav.done` polls it. On CPU (or without
        a stream) the work is simply done here. ``marks`` (the engine's timestamp source, with
        ``mark(stream)``) records start / flow done / HiFT done in ``PendingToken2Wav.marks``.
        """
        if not jobs:
            return PendingToken2Wav([], [], None)
        ctx = torch.cuda.stream(stream) if stream is not None else _null()
        stamps = []
        with ctx:
            if marks is not None:
                stamps.append(marks.mark(stream))
            dev = self.device
            mels = self.flow.inference_batch(
                [j.tokens.to(dev, non_blocking=True)[None] for j in jobs],
                [j.voice.flow_speech_token.to(dev, non_blocking=True)[None] for j in jobs],
                [j.voice.speech_feat.to(dev, non_blocking=True)[None] for j in jobs],
                torch.stack([j.voice.flow_embedding for j in jobs]).to(dev, non_blocking=True),
                streaming=[j.streaming for j in jobs],
                finalize=[j.finalize for j in jobs],
            )
            if marks is not None:
                stamps.append(marks.mark(stream))
            hift_dev = next(self.hift.parameters()).device
            chunks = []
            for j, mel in zip(jobs, mels):
                m = mel[:, :, j.token_offset * self.ratio:].to(hift_dev, torch.float32)
                if j.finalize and j.speed != 1.0 and j.hift_state.empty:
                    m = F.interpolate(m, size=max(1, int(m.shape[2] / j.speed)), mode="linear")
                chunks.append(m)
            out = hift_stream_step_batch(
                self.hift, [j.hift_state for j in jobs], chunks, [j.finalize for j in jobs],
                [j.generator for j in jobs],
            )
            speech = [s[0].float() for s, _ in out]
            if marks is not None:
                stamps.append(marks.mark(stream))
            event = None
            if stream is not None:
                host = [torch.empty(s.shape, dtype=torch.float32, pin_memory=True) for s in speech]
                for h, s in zip(host, speech):
                    h.copy_(s, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                speech = host
        return PendingToken2Wav(speech, [st for _, st in out], event, keep=(jobs, mels, chunks), marks=tuple(stamps))

    def finish(self, pending: "PendingToken2Wav") -> list[Token2WavResult]:
        """Wait for ``pending`` and return its results (speech on the CPU)."""
        if pending.event is not None:
            pending.event.synchronize()
        return [Token2WavResult(s.cpu() if s.device.type != "cpu" else s, st)
                for s, st in zip(pending.speech, pending.states)]


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@dataclass
class PendingToken2Wav:
    """A token2wav batch in flight: per-job speech (pinned host buffers being filled, or
    CPU/device tensors), next HiFT states, and the CUDA event that marks completion."""

    speech: list
    states: list
    event: "torch.cuda.Event | None"
    keep: tuple = ()
    marks: tuple = ()  # (start, flow done, HiFT done) timestamps when the engine asked for them

    def done(self) -> bool:
        return self.event is None or self.event.query()
