"""token2wav: speech tokens -> waveform chunks, batched across streams.

One :class:`Token2WavJob` is one call of upstream ``CosyVoice2Model.token2wav``: the flow
turns ``[prompt tokens, tokens[:end]]`` into mel (chunk-causal attention for non-final
streaming chunks, look-ahead tokens excluded), the frames before ``token_offset`` are
dropped, and HiFT turns the rest into audio with the stream's cache (8-frame mel
overlap, 3840-sample excitation and speech overlap with a Hamming cross-fade). Jobs of
different streams that are ready at the same time run as ONE flow batch and ONE HiFT
batch; each keeps its own caches and random generator, and its result equals what it
would be alone (see the batching tests).

The first chunk of a stream therefore costs one flow solve over prompt + first chunk;
upstream's later chunks recompute the flow over everything so far (the chunk-causal
attention makes earlier frames unchanged, and the look-ahead tokens of the last chunk are
refined when more tokens arrive). With a per-stream :class:`~cosyserve.models.flow.FlowStreamCache`
in the job (``Token2WavJob.flow_cache``, the engine's ``--flow-stream-cache on``), a non-final
chunk's flow solve covers only the frames from the first static chunk that was incomplete in
the stream's previous call (the earlier frames' per-step keys/values and convolution contexts
come from the cache): the same mel (docs/architecture.md, "Flow stream cache"). A stream's first
cached chunk starts from its voice's prompt prefix (:class:`PromptPrefixes`): the prompt's complete
chunks, computed once per voice by the first stream that needs them.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import SettingsError
from ..frontend.voice import Voice, flow_prompt_digest
from ..models.hift import HiFTGenerator, HiFTStreamState, hift_stream_step_batch

log = logging.getLogger(__name__)

#: :class:`VoicePrefixPool` builds a voice's prompt prefix once this many of its streams have started (a voice used
#: by one stream, a per-request prompt, would pay an eager build on the engine thread for nothing)
PREFIX_MIN_STREAMS = 2
#: voices whose started streams :class:`VoicePrefixPool` counts (least recently started out)
PREFIX_COUNTED_VOICES = 1024
#: the share of wall time :class:`VoicePrefixPool`'s background builds may take (after a build of ``h`` seconds the
#: next starts ``h * (1 / share - 1)`` later at the earliest): more voices in use than slots must not keep the worker
#: thread building (and taking the GIL from the engine thread) all the time
PREFIX_BUILD_DUTY = 0.25


@dataclass
class Token2WavJob:
    """One token2wav call.

    ``tokens``: int tensor ``[N]`` of speech tokens passed to the flow (all tokens so far,
    up to and including the look-ahead for non-final chunks). ``token_offset``: tokens
    already turned into audio by earlier chunks. ``finalize``: last chunk of the segment
    (no look-ahead exclusion, no held-back tail). ``streaming``: chunk-causal flow
    attention (upstream passes ``stream`` for non-final chunks only). ``flow_cache``: the
    stream's :class:`~cosyserve.models.flow.FlowStreamCache` (owned by the engine's segment
    state, read and extended in place by the flow) or None (full recomputation).
    """

    voice: Voice
    tokens: torch.Tensor
    token_offset: int
    finalize: bool
    streaming: bool
    hift_state: HiFTStreamState
    generator: torch.Generator | None
    speed: float = 1.0
    flow_cache: object | None = None


@dataclass
class Token2WavResult:
    speech: torch.Tensor          # [N] float32 on CPU
    hift_state: HiFTStreamState   # state for the next chunk (empty after a final chunk)
    #: flow input tokens (of the job's :meth:`Token2WavBackend.cost_tokens`) whose frames the flow did not solve:
    #: a voice prompt prefix or a stream cache covered them (the capacity model prices the rest)
    saved_tokens: int = 0


class PromptPrefixes:
    """Per voice, the flow stream cache of its prompt's complete chunks
    (:meth:`~cosyserve.models.flow.FlowModel.prompt_prefix_frames`), which every stream of the voice
    computes identically: a stream's first cached chunk adopts it
    (:meth:`~cosyserve.models.flow.FlowStreamCache.adopt`) and solves only the frames after it. The
    first stream of a voice builds it in its own first call (its commit limited to the prefix:
    ``FlowStreamCache.commit_limit``). Keyed by the voice's content (flow prompt tokens, prompt mel,
    speaker embedding: CPU tensors, hashed), so two voice objects with the same prompt share one and a
    per-request prompt never meets another's. Least recently used first out once the prefixes hold
    more than ``max_bytes`` (device memory; a prefix alone larger than that is not kept). Counters:
    :attr:`hits`, :attr:`builds`. Not thread-safe (the engine thread launches the batches)."""

    def __init__(self, max_bytes: int = 1 << 31):
        self.max_bytes = int(max_bytes)
        self._d: OrderedDict[bytes, object] = OrderedDict()
        self.hits = self.builds = 0

    @staticmethod
    def key(voice: Voice) -> bytes:
        """The content key of ``voice``'s flow prompt (its tokens, mel and speaker embedding:
        :func:`~cosyserve.frontend.voice.flow_prompt_digest`), kept on a :class:`Voice`
        (:attr:`Voice.flow_prompt_key`), computed for other objects with those tensors."""
        key = getattr(voice, "flow_prompt_key", None)
        return key if key is not None else flow_prompt_digest(voice)

    def get(self, key: bytes):
        """The prefix cache of ``key`` (None if none), marked as recently used."""
        prefix = self._d.get(key)
        if prefix is not None:
            self._d.move_to_end(key)
            self.hits += 1
        return prefix

    def put(self, key: bytes, prefix) -> None:
        """Keep ``prefix`` (a :class:`~cosyserve.models.flow.FlowStreamCache`) for ``key``; drop the
        least recently used ones beyond :attr:`max_bytes` (one larger than that alone is not kept and
        drops nothing)."""
        if prefix.nbytes() > self.max_bytes:
            return
        self._d[key] = prefix
        self._d.move_to_end(key)
        self.builds += 1
        while self._d and self.nbytes() > self.max_bytes:
            self._d.popitem(last=False)

    def nbytes(self) -> int:
        """Device bytes the kept prefixes hold."""
        return sum(p.nbytes() for p in self._d.values())

    def __len__(self) -> int:
        return len(self._d)


class VoicePrefixPool:
    """The voices' prompt prefixes in a fixed device pool (``--flow-stream-cache prefix``): a non-final
    streaming job of a voice whose prefix the pool holds solves only the frames after it
    (:meth:`~cosyserve.models.flow.FlowModel.start_prefixed`, :mod:`~cosyserve.models.flow_prefix`); no
    stream keeps a cache of its own. ``slots`` voices, ``max_frames`` prefix frames each (a longer
    prompt's prefix is cut to whole chunks within it: still exact). A voice's prefix is built the first
    time a batch needs it (one eager streaming call of its prompt with a few placeholder tokens, its
    commit limited to the prefix: :meth:`~cosyserve.models.flow.FlowModel.prompt_prefix_frames`), in the
    least recently used slot that the batch does not read; a batch with more voices than that leaves the
    rest without prefix (full solves). A stream's first chunk never waits for a build (it runs whole when
    its voice has no prefix yet): the build, an eager solve, happens for a later chunk, so a voice used by
    one stream only (a per-request prompt) costs its first chunk nothing. A prefix is built only for a voice
    of which :data:`PREFIX_MIN_STREAMS` streams have started (first chunks counted per voice, for the
    :data:`PREFIX_COUNTED_VOICES` most recent voices): the build is an eager flow call on the engine thread,
    which delays every stream's next batch, and a voice of one stream (a per-request prompt) would pay it for
    nothing. Keyed by the voice's content (:meth:`PromptPrefixes.key`), so a prompt sent again counts as
    the same voice. Each build is logged (``event=prefix_build``, its host milliseconds).

    ``background=True`` (the engine's default, ``EngineConfig.flow_prefix_build``): a build needed while serving
    runs on a worker thread of its own (on CUDA on a CUDA stream of its own, after the work already issued on
    the caller's stream, so a batch launched earlier still reads the evicted voice's slot intact) instead of
    holding the engine thread for the eager solve (683-942 ms host time at full size on an H200, session 39);
    the voice's chunks run without prefix until :meth:`assign` finds the build done (then the caller's stream
    waits for the build's device work before any batch reads the slot). One build at a time; its slot is
    reserved (no other voice's build or batch uses it meanwhile), and builds take at most ``build_duty`` of the
    wall time (:data:`PREFIX_BUILD_DUTY`). A build that raises is logged and leaves the voice without prefix.
    :meth:`prebuild` always builds on the calling thread (before serving).
    Counters: :attr:`hits`, :attr:`builds`, :attr:`deferred` (later chunks that could have built a prefix but
    whose voice had too few streams), :attr:`building` (chunks whose voice's build was under way).
    Not thread-safe (the engine thread launches the batches; the worker only fills its reserved slot)."""

    def __init__(self, flow, slots: int, max_frames: int, background: bool = False):
        from ..models.flow_prefix import PrefixPool

        chunk = flow.decoder.estimator.cfg.static_chunk_size
        if chunk <= 0 or max_frames < chunk:
            raise SettingsError(f"--flow-stream-cache prefix needs chunk-causal streaming and at least one chunk "
                                f"({chunk} frames) per voice (--flow-stream-cache-frames), got {max_frames} frames")
        self.flow, self.chunk = flow, chunk
        self.pool = PrefixPool.for_flow(flow, slots, max_frames // chunk * chunk)
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # voice key -> slot, least recently used first
        self._none: set[bytes] = set()  # voices whose prompt has no complete chunk: no prefix
        self._started: OrderedDict[bytes, int] = OrderedDict()  # voice key -> its streams started (first chunks)
        self.hits = self.builds = self.deferred = self.building = 0
        self.background = bool(background)
        self.build_duty = PREFIX_BUILD_DUTY
        self._next_build = 0.0  # time.monotonic() before which no background build starts (build_duty)
        self._worker = None  # concurrent.futures executor of the background builds (made at the first one)
        self._stream = None  # their CUDA stream
        self._pending: dict[bytes, tuple] = {}  # voice key -> (slot, voice id, future) of a build under way

    def close(self) -> None:
        """Stop the background worker (a build under way finishes; one not started is dropped)."""
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
            self._worker = None

    def wait_builds(self, timeout: float | None = None) -> None:
        """Block until the background builds under way are done, at most ``timeout`` seconds (for tests); the
        next :meth:`assign` then takes them in."""
        import concurrent.futures

        futures = [f for _, _, f in self._pending.values()]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout)

    def nbytes(self) -> int:
        """Device bytes of the pool (allocated up front)."""
        return self.pool.nbytes()

    def assign(self, jobs: list) -> tuple[list[int], list[int]]:
        """Per job ``(slot, start)``: the prefix slot and its frames for a non-final streaming job without
        a stream cache whose voice has (or now gets) a prefix, else ``(0, 0)``. Builds missing prefixes
        for jobs past their stream's first chunk only: eagerly on the current CUDA stream, or with
        ``background`` started on the worker thread (the job then runs without prefix) and taken in by a
        later call."""
        slots, starts, used = [], [], set()
        if self._pending:
            self._collect()
        prefixed = [job.streaming and not job.finalize and job.flow_cache is None for job in jobs]
        for job, ok in zip(jobs, prefixed):  # this batch's first chunks count before its later chunks build
            if ok and job.token_offset == 0:
                self._count_start(PromptPrefixes.key(job.voice))
        for job, ok in zip(jobs, prefixed):
            slot = None
            if ok:
                slot = self._slot(job.voice, used, build=job.token_offset > 0)
            if slot is None:
                slots.append(0)
                starts.append(0)
            else:
                used.add(slot)
                slots.append(slot)
                starts.append(self.pool.frames[slot])
        return slots, starts

    def _slot(self, voice: Voice, used: set, build: bool = True, inline: bool = False) -> int | None:
        key = PromptPrefixes.key(voice)
        if key in self._none:
            return None
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
            self.hits += 1
            return slot
        if not build:
            return None
        if key in self._pending:
            self.building += 1
            return None
        if self._started.get(key, 0) < PREFIX_MIN_STREAMS:
            self.deferred += 1
            return None
        background = self.background and not inline
        if background and (self._pending or time.monotonic() < self._next_build):
            self.building += 1  # one build at a time, build_duty of the time: this voice's turn comes later
            return None
        taken = set(self._slots.values()) | {s for s, _, _ in self._pending.values()}
        free = [s for s in range(self.pool.slots) if s not in taken]
        if free:
            slot = free[0]
        else:  # the least recently used voice whose slot this batch does not read
            victim = next((k for k, s in self._slots.items() if s not in used), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
        if background:
            self._submit(key, slot, voice)
            self.building += 1
            return None
        t0 = time.perf_counter()
        if not self._build(slot, voice):
            self._none.add(key)
            return None
        self._built(key, slot, getattr(voice, "id", None), (time.perf_counter() - t0) * 1e3, background=False)
        return slot

    def _built(self, key: bytes, slot: int, voice_id, host_ms: float, background: bool) -> None:
        self._slots[key] = slot
        self.builds += 1
        log.info("flow prompt prefix built for voice %s in slot %d: %.0f ms on %s (eager; %d builds)",
                 voice_id or "?", slot, host_ms, "a worker thread" if background else "the engine thread",
                 self.builds, extra={"event": "prefix_build", "voice": voice_id, "slot": slot,
                                     "host_ms": round(host_ms, 1), "builds": self.builds, "background": background})

    def _submit(self, key: bytes, slot: int, voice: Voice) -> None:
        """Start the build of ``voice``'s prefix into the reserved ``slot`` on the worker thread, after the
        work issued so far on the current CUDA stream (batches that may still read the slot's old voice: the
        engine keeps one token2wav batch in flight and launches the next only once it is done, so every batch
        that read the slot has been issued by now)."""
        import concurrent.futures

        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cosyserve-prefix")
        after = None
        device = self.pool.keys.device
        if device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=device)
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(device))
        self._pending[key] = (slot, getattr(voice, "id", None), self._worker.submit(self._build_on_worker, slot,
                                                                                     voice, after))

    def _build_on_worker(self, slot: int, voice: Voice, after) -> tuple[bool, object, float, Exception | None]:
        """(Worker thread.) :meth:`_build` on the pool's own CUDA stream once ``after`` (an event of the
        caller's stream) has passed; returns (built, an event recorded after it or None, host ms, the exception
        the build raised or None)."""
        t0 = time.perf_counter()
        ok, done, error = False, None, None
        try:
            if self._stream is None:
                ok = self._build(slot, voice)
            else:
                with torch.cuda.device(self._stream.device), torch.cuda.stream(self._stream):
                    self._stream.wait_event(after)
                    ok = self._build(slot, voice)
                    done = torch.cuda.Event()
                    done.record(self._stream)
        except Exception as exc:  # noqa: BLE001 - reported by _collect: the voice then runs without prefix
            error = exc
        return ok, done, (time.perf_counter() - t0) * 1e3, error

    def _collect(self) -> None:
        """Take in the background builds that are done: their voices get their slots (the current CUDA stream
        waits for the build's device work); a failed build leaves its voice without prefix, its slot free."""
        for key, (slot, voice_id, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[key]
            ok, done, host_ms, error = future.result()
            self._next_build = time.monotonic() + host_ms / 1e3 * (1 / self.build_duty - 1)
            if error is not None:  # a prefix only saves work: serve the voice without one
                log.warning("flow prompt prefix build for voice %s failed (%s: %s); its streams run without prefix",
                            voice_id or "?", type(error).__name__, error,
                            extra={"event": "prefix_build_failed", "voice": voice_id})
                self._none.add(key)  # (its slot is free again: the next build, on the same stream, overwrites it)
                continue
            if not ok:
                self._none.add(key)
                continue
            if done is not None:
                torch.cuda.current_stream(self._stream.device).wait_event(done)
            self._built(key, slot, voice_id, host_ms, background=True)

    def prebuild(self, voices: list) -> int:
        """Build the prefixes of ``voices`` now (before serving: the builds are eager and would otherwise fall on
        the engine thread while streams run), at most one per free slot, the first ones first; each counts as a
        voice of several streams (a registered voice), so a later rebuild after eviction does not wait for two
        more. Returns the number built (voices with a prefix already, or without a complete prompt chunk, are
        skipped)."""
        built = 0
        for voice in voices:
            key = PromptPrefixes.key(voice)
            self._started[key] = max(self._started.pop(key, 0), PREFIX_MIN_STREAMS)
            if key in self._slots or key in self._none:
                continue
            if len(self._slots) + len(self._pending) >= self.pool.slots:
                break
            before = self.builds
            self._slot(voice, set(), build=True, inline=True)
            built += self.builds - before
        return built

    def _count_start(self, key: bytes) -> None:
        """One more stream of the voice ``key`` started (its first chunk is in a batch)."""
        self._started[key] = self._started.pop(key, 0) + 1
        while len(self._started) > PREFIX_COUNTED_VOICES:
            self._started.popitem(last=False)

    @torch.inference_mode()
    def _build(self, slot: int, voice: Voice) -> bool:
        from ..models.flow import FlowStreamCache

        flow = self.flow
        n_prompt = int(voice.flow_speech_token.numel())
        frames = min(flow.prompt_prefix_frames(n_prompt), self.pool.max_frames)
        if frames <= 0:
            self.pool.clear(slot)
            return False
        builder = FlowStreamCache()
        builder.commit_limit = frames
        # the prefix's frames read the prompt alone: any tokens after it give the same prefix
        filler = torch.zeros(flow.pre_lookahead_len + 1, dtype=torch.long)
        flow.inference_batch([filler], [voice.flow_speech_token], [voice.speech_feat],
                             voice.flow_embedding.reshape(1, -1), [True], [False], caches=[builder])
        self.pool.put(slot, builder.estimator)
        builder.clear()
        return True


def make_token2wav(models):
    """The token2wav backend for ``models`` (:class:`~cosyserve.models.loader.CosyVoice2Models`):
    the DiT backend when a Step-Audio2 token2wav directory was attached (``models.dit``), the
    CosyVoice3 backend (:class:`~cosyserve.engine.token2wav_cv3.Cv3Token2WavBackend`) for a
    CosyVoice3 model, else CosyVoice2's :class:`Token2Wav`."""
    if getattr(models, "dit", None) is not None:
        from .token2wav_dit import DitToken2WavBackend

        return DitToken2WavBackend(models.dit)
    if getattr(models.cfg, "is_cosyvoice3", False):
        from .token2wav_cv3 import Cv3Token2WavBackend

        return Cv3Token2WavBackend(models.flow, models.hift, models.cfg.token_mel_ratio)
    return Token2Wav(models.flow, models.hift, models.cfg.token_mel_ratio)


class Token2WavBackend:
    """What every token2wav backend shares on top of its own ``launch(jobs, stream=None, ...)`` /
    ``finish(pending)`` (CosyVoice2 :class:`Token2Wav`, CosyVoice3 and Step-Audio2 DiT backends)."""

    def cost_tokens(self, prompt_tokens: int, end: int, token_offset: int) -> int:
        """Flow input length (speech tokens) of a job covering tokens ``[token_offset, end)`` of a
        request with ``prompt_tokens`` flow prompt tokens, for the engine's batch budgets. The
        CosyVoice2/3 flows re-run the prompt and every token so far on each chunk: ``prompt + end``."""
        return prompt_tokens + end

    #: whether a stream's chunks cost more the longer it runs (the CosyVoice2/3 flows re-run the prompt
    #: and every token so far on each chunk; the DiT's chunks attend a bounded cache). The capacity model
    #: then fits token2wav batches against their :meth:`cost_tokens` instead of their audio and prices a
    #: stream at the cost units per audio second measured (:class:`~cosyserve.engine.admission.CapacityEstimator`,
    #: ``t2w_price="cost"``)
    chunk_cost_grows = True

    #: how many times :meth:`stream_state_bytes` the engine's memory bound budgets per stream: a backend
    #: that makes a batch's new caches while the old ones are alive holds both for the batch's streams
    #: (and fragments the allocator with caches of changing sizes): 1.5
    stream_state_copies = 1.5

    def state_bytes(self, state, flow_cache=None) -> int:
        """Device bytes the caches of one stream's state (a job's ``hift_state`` and ``flow_cache``) hold
        now; 0 where :meth:`stream_state_bytes` is 0."""
        return 0

    def stream_state_bytes(self) -> int:
        """Device bytes one streaming segment's per-stream caches hold at most (the largest seen so
        far), for the engine's memory bound on admission; 0 where they are small next to the
        model (the CosyVoice2/3 flows without their flow stream cache recompute each chunk: their
        streams hold only the HiFT state)."""
        return 0

    @torch.inference_mode()
    def run(self, jobs: list[Token2WavJob]) -> list[Token2WavResult]:
        """Run ``jobs`` as one batch; results in job order (blocking)."""
        return self.finish(self.launch(jobs, stream=None))

    def run_each(self, jobs: list[Token2WavJob], stream=None) -> list:
        """Run every job alone (after a batch failed): per job its :class:`Token2WavResult` or
        the exception it raised, so one bad request fails alone (blocking)."""
        out = []
        for job in jobs:
            try:
                out.append(self.finish(self.launch([job], stream=stream))[0])
            except Exception as exc:  # noqa: BLE001 - isolate the failing job
                out.append(exc)
        return out


class FlowStepTimes:
    """Measured device seconds of one flow Euler step, by the solver's ``(rows, frames)`` shape
    (:attr:`FlowRun.cost_key <cosyserve.models.flow.FlowRun.cost_key>`; with CUDA graphs the
    bucket, so a few dozen keys): what bounds how many steps a batch queues ahead of the GPU
    (``EngineConfig.t2w_queue_s``, :meth:`PendingToken2Wav.advance`).

    Each key keeps an exponential moving average (weight ``alpha`` for the newest step) of the
    steps measured with CUDA timing events on the token2wav stream, i.e. the step's duration on a
    GPU shared with the LM. A key never measured is estimated from the measured key of the nearest
    work (rows x frames) scaled linearly by the work (a step of few rows costs more per row than
    that, so a small batch is estimated cheap and queued as before; a large one, dear and queued
    one step at a time); None before any step was measured.
    """

    def __init__(self, alpha: float = 0.25):
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"FlowStepTimes: alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._ema: dict[tuple[int, int], float] = {}

    def observe(self, key: tuple[int, int], seconds: float) -> None:
        """One step of shape ``key`` took ``seconds`` on the device (ignored unless > 0)."""
        if not seconds > 0.0:
            return
        old = self._ema.get(key)
        self._ema[key] = seconds if old is None else old + self.alpha * (seconds - old)

    def estimate(self, key: tuple[int, int] | None) -> float | None:
        """Device seconds one step of shape ``key`` is expected to take (None: nothing measured
        yet, or ``key`` None)."""
        if key is None:
            return None
        got = self._ema.get(key)
        if got is not None or not self._ema:
            return got
        work = max(1, key[0] * key[1])
        near = min(self._ema, key=lambda k: abs(math.log(max(1, k[0] * k[1]) / work)))
        return self._ema[near] * work / max(1, near[0] * near[1])

    def snapshot(self) -> dict[tuple[int, int], float]:
        """The measured keys and their averaged step seconds (a copy)."""
        return dict(self._ema)


class Token2Wav(Token2WavBackend):
    """Batched flow + HiFT over :class:`Token2WavJob`s.

    ``flow`` runs in its own dtype on its device; HiFT takes float32 mel (its convolution trunk
    may run in half precision: :meth:`HiFTGenerator.set_trunk_dtype`). ``token_mel_ratio``
    comes from the model configuration.
    """

    def __init__(self, flow, hift: HiFTGenerator, token_mel_ratio: int):
        self.flow = flow
        self.hift = hift
        self.ratio = token_mel_ratio
        self._state_bytes = 0  # the largest flow stream cache seen (stream_state_bytes)
        #: the voices' prompt prefixes for the streams' first cached chunks
        self.prefixes = PromptPrefixes()
        #: the voices' prompt prefixes in a fixed device pool (:meth:`enable_prompt_prefixes`; None: off)
        self.prefix_pool: VoicePrefixPool | None = None
        #: one flow step's device time by solver shape, measured while batches run with ``queue_s``
        self.step_times = FlowStepTimes()

    @property
    def supports_prompt_prefixes(self) -> bool:
        """Whether :meth:`enable_prompt_prefixes` can be used: CosyVoice2's one-level U-Net flow (its
        estimator's stream caches, :attr:`~cosyserve.models.flow.FlowModel.supports_stream_cache`; not the
        CosyVoice3 backend, whose own flow caches :attr:`supports_flow_cache` reports)."""
        return bool(getattr(self.flow, "supports_stream_cache", False))

    def enable_prompt_prefixes(self, slots: int, max_frames: int, background: bool = False) -> None:
        """Non-final streaming jobs start from their voice's prompt prefix, kept for ``slots`` voices of at
        most ``max_frames`` frames each in a device pool allocated now (:class:`VoicePrefixPool`; the
        engine's ``--flow-stream-cache prefix``); ``background``: prefixes needed while serving are built on a
        worker thread (:class:`VoicePrefixPool`). Raises SettingsError (a ValueError) where the flow cannot
        (:attr:`supports_prompt_prefixes`, no chunk-causal streaming) or for sizes below one chunk."""
        if not self.supports_prompt_prefixes:
            raise SettingsError("--flow-stream-cache prefix needs a one-level U-Net flow estimator (CosyVoice2)")
        self.prefix_pool = VoicePrefixPool(self.flow, slots, max_frames, background=background)

    @property
    def supports_flow_cache(self) -> bool:
        """Whether jobs may carry a :class:`~cosyserve.models.flow.FlowStreamCache` (a one-level
        U-Net estimator: CosyVoice2)."""
        return bool(getattr(self.flow, "supports_stream_cache", False))

    def _unet_caches(self, jobs) -> list:
        """The jobs' :class:`~cosyserve.models.flow.FlowStreamCache` for the flow pass (None: none)."""
        return [j.flow_cache for j in jobs]

    def new_flow_cache(self, max_frames: int | None = None):
        """An empty :class:`~cosyserve.models.flow.FlowStreamCache` for one stream."""
        from ..models.flow import FlowStreamCache

        return FlowStreamCache(max_frames)

    def flow_cache_bytes(self, flow_cache) -> int:
        """Device bytes a stream's flow cache (a job's ``flow_cache``: a
        :class:`~cosyserve.models.flow.FlowStreamCache`) holds now; 0 for None."""
        return 0 if flow_cache is None else int(flow_cache.nbytes())

    def state_bytes(self, state, flow_cache=None) -> int:
        """Device bytes of a stream's flow stream cache (its HiFT state is small)."""
        return self.flow_cache_bytes(flow_cache)

    def stream_state_bytes(self) -> int:
        """The largest flow stream cache seen after a batch (bytes; ~2.2 MiB per cached frame at full
        size in bf16: a stream of 20 s after a 5 s prompt grows to ~2.6 GiB); 0 while the engine runs
        without flow stream caches (``EngineConfig.flow_stream_cache``, off by default on CUDA)."""
        return self._state_bytes

    def length_bucket(self, n_tokens: int) -> int:
        """Flow input length (tokens) a batch whose longest job takes ``n_tokens`` is padded
        to: the flow graph's token bucket on CUDA, else ``n_tokens`` rounded up to 32."""
        graph = getattr(self.flow, "graph", None)
        if graph is not None:
            return graph.grid.length(n_tokens)
        return -(-n_tokens // 32) * 32

    def batch_bucket(self, n_jobs: int) -> int:
        """Rows a batch of ``n_jobs`` jobs computes: the flow graph's batch bucket on CUDA
        (:func:`~cosyserve.models.graphs.half_octave_buckets`), else (or beyond the grid)
        ``n_jobs``."""
        graph = getattr(self.flow, "graph", None)
        key = graph.grid.pick(n_jobs, 1) if graph is not None else None
        return n_jobs if key is None else key[0]

    @property
    def hift_device(self) -> torch.device:
        """Where HiFT runs (and its excitation noise is drawn)."""
        return next(self.hift.parameters()).device

    @torch.inference_mode()
    def launch(self, jobs: list[Token2WavJob], stream=None, marks=None,
               queue_steps: int | None = None, queue_s: float | None = None) -> "PendingToken2Wav":
        """Enqueue ``jobs`` without waiting for the GPU.

        With a CUDA ``stream``, all work is issued on it (inputs are created there too, so
        the caching allocator never hands their memory to another stream early) and an
        event marks completion; :meth:`PendingToken2Wav.done` polls it. On CPU (or without
        a stream) the work is simply done here. ``marks`` (the engine's timestamp source, with
        ``mark(stream)``) records start / flow done / HiFT done in ``PendingToken2Wav.marks``.

        ``queue_steps``: issue the flow's Euler steps only while fewer than this many issued
        steps are unfinished on the GPU; :meth:`PendingToken2Wav.advance` issues the rest
        (then HiFT), called by the engine between LM steps. A whole batch at once can hold the
        calling thread in the driver until the GPU has worked through most of it (the stream's
        launch queue is shorter than a 10-step solve). ``None``: issue everything now.
        ``queue_s`` (seconds, with ``queue_steps``): a second step is queued only while the
        unfinished steps, at the device time :attr:`step_times` expects per step of this
        batch's shape, stay within it — one step at a time for a large batch's long steps
        (each measured as it runs), up to ``queue_steps`` for a lone stream's short ones.
        """
        pending = PendingToken2Wav(self, jobs, stream, marks)
        if not jobs:
            pending.speech, pending.states, pending.issued = [], [], True
            return pending
        with pending.on_stream():
            if marks is not None:
                pending.stamps.append(marks.mark(stream))
            inputs = self.flow.prepare(  # CPU inputs: copied without host synchronisation
                [j.tokens for j in jobs],  # 1-D / 2-D as they are (prepare takes both): no per-job views
                [j.voice.flow_speech_token for j in jobs],
                [j.voice.speech_feat for j in jobs],
                torch.stack([j.voice.flow_embedding for j in jobs]),
                streaming=[j.streaming for j in jobs],
                finalize=[j.finalize for j in jobs],
            )
            caches = self._unet_caches(jobs)
            slots, starts = self.prefix_pool.assign(jobs) if self.prefix_pool is not None else ([], [])
            if any(c is not None for c in caches):  # stream-cached: eager (no CUDA graph)
                pending.prefix_builds = self._seed_prefixes(jobs, caches)
                pending.saved = [0 if c is None else c.frames // self.ratio for c in caches]
                pending.run = self.flow.start(inputs, caches=caches)
            elif any(starts):  # from the voices' prompt prefixes
                pending.saved = [s // self.ratio for s in starts]
                pending.run = self.flow.start_prefixed(inputs, self.prefix_pool.pool, slots, starts)
            else:
                pending.run = self.flow.start(inputs)
        pending.advance(queue_steps, queue_s)
        return pending

    def _seed_prefixes(self, jobs, caches) -> list:
        """Before a stream-cached flow pass: each stream's first cached chunk (an empty cache) adopts its
        voice's prompt prefix, or, without one, builds it (its commit limited to the prefix's frames).
        Returns the builds: ``(key, cache, prompt tokens, frames)`` for :meth:`finish`."""
        builds = []
        for job, cache in zip(jobs, caches):
            if cache is None or not job.streaming or job.finalize or cache.frames > 0:
                continue
            n_prompt = int(job.voice.flow_speech_token.numel())
            frames = self.flow.prompt_prefix_frames(n_prompt)
            if frames <= 0 or (cache.max_frames is not None and frames > cache.max_frames):
                continue  # (a stream capped below the prefix caches less than it)
            key = self.prefixes.key(job.voice)
            prefix = self.prefixes.get(key)
            if prefix is not None:
                cache.adopt(prefix)
            else:
                cache.commit_limit = frames
                builds.append((key, cache, n_prompt, frames))
        return builds

    def _issue_hift(self, p: "PendingToken2Wav") -> None:
        """After the flow's last step: HiFT on the new frames, copies to pinned host buffers,
        the completion event (on ``p``'s stream)."""
        jobs, marks, stream = p.jobs, p.marks_src, p.stream
        mels = p.run.mels()
        if marks is not None:
            p.stamps.append(marks.mark(stream))
        hift_dev = self.hift_device
        chunks = []
        starts = getattr(p.run, "mel_starts", (0,) * len(jobs))
        for j, mel, start in zip(jobs, mels, starts):
            skip = j.token_offset * self.ratio - start  # a stream-cached mel starts at frame `start`
            if skip < 0:
                raise RuntimeError(f"flow stream cache: the mel starts at frame {start}, after the chunk's first "
                                   f"new frame {j.token_offset * self.ratio}")
            m = mel[:, :, skip:] if skip else mel
            if m.device != hift_dev or m.dtype != torch.float32:
                m = m.to(hift_dev, torch.float32)
            if j.finalize and j.speed != 1.0 and j.hift_state.empty:
                m = F.interpolate(m, size=max(1, int(m.shape[2] / j.speed)), mode="linear")
            chunks.append(m)
        out = hift_stream_step_batch(
            self.hift, [j.hift_state for j in jobs], chunks, [j.finalize for j in jobs],
            [j.generator for j in jobs],
        )
        speech = [s[0] if s.dtype == torch.float32 else s[0].float() for s, _ in out]
        if marks is not None:
            p.stamps.append(marks.mark(stream))
        if stream is not None:
            speech, p.event = copy_to_pinned_host(speech, stream)
        p.speech, p.states = speech, [st for _, st in out]
        p.keep = (mels, chunks)

    def finish(self, pending: "PendingToken2Wav") -> list[Token2WavResult]:
        """Issue whatever is left of ``pending``, wait for it and return its results (speech on
        the CPU)."""
        pending.advance(None)
        if pending.event is not None:
            pending.event.synchronize()
        pending._queued()  # every step finished: the timed ones report their device time
        for job in pending.jobs:  # the streams' flow caches have grown: the memory bound's per-stream size
            if job.flow_cache is not None:
                self._state_bytes = max(self._state_bytes, self.flow_cache_bytes(job.flow_cache))
        for key, cache, n_prompt, frames in pending.prefix_builds:  # committed exactly the prompt's chunks
            if cache.frames == frames:
                self.prefixes.put(key, cache.prompt_prefix(n_prompt))
        saved = pending.saved or [0] * len(pending.speech)
        return [Token2WavResult(s.cpu() if s.device.type != "cpu" else s, st, n)
                for s, st, n in zip(pending.speech, pending.states, saved)]


def copy_to_pinned_host(speech: list[torch.Tensor], stream) -> tuple[list[torch.Tensor], "torch.cuda.Event"]:
    """Enqueue on ``stream`` (a ``torch.cuda.Stream``, current while this runs) non-blocking copies
    of the device waveforms ``speech`` (float32 tensors of any shape) into fresh pinned host float32
    buffers of the same shapes; return the buffers and a CUDA event recorded after the copies (the
    buffers hold the speech once it has completed). Shared by the CosyVoice2, CosyVoice3 and DiT
    token2wav backends. Raises RuntimeError (from torch) when CUDA is unavailable."""
    host = [torch.empty(s.shape, dtype=torch.float32, pin_memory=True) for s in speech]
    for h, s in zip(host, speech):
        h.copy_(s, non_blocking=True)
    event = torch.cuda.Event()
    event.record(stream)
    return host, event


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class PendingToken2Wav:
    """A token2wav batch in flight (:meth:`Token2Wav.launch`).

    Until :attr:`issued`, part of it (flow steps, then HiFT) is still to be enqueued by
    :meth:`advance`. Then ``speech`` holds per job the speech (pinned host buffers being
    filled, or CPU/device tensors), ``states`` the next HiFT states, ``event`` the CUDA event
    that marks completion, ``marks`` the (start, flow done, HiFT done) timestamps when asked.
    """

    def __init__(self, t2w: Token2Wav, jobs: list, stream=None, marks_src=None):
        self.t2w, self.jobs, self.stream, self.marks_src = t2w, jobs, stream, marks_src
        self.run = None
        self.issued = False
        self.speech: list = []
        self.states: list = []
        self.event = None
        self.keep: tuple = ()
        self.prefix_builds: list = []  # voices' prompt prefixes this batch builds (Token2Wav._seed_prefixes)
        self.saved: list = []  # per job, flow input tokens a prefix or stream cache spares it (Token2WavResult)
        self.stamps: list = []
        self._step_events: list = []

    @property
    def marks(self) -> tuple:
        return tuple(self.stamps)

    def on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else _null()

    def _queued(self) -> int:
        """Issued steps not finished on the GPU; each finished timed step (``(start, end)`` events)
        reports its device time to the backend's :class:`FlowStepTimes`."""
        while self._step_events and self._step_events[0][1].query():
            begin, end = self._step_events.pop(0)
            if begin is not None:
                self.t2w.step_times.observe(self.run.cost_key, begin.elapsed_time(end) / 1000.0)
        return len(self._step_events)

    def _may_queue(self, queued: int, queue_steps: int, queue_s: float | None, key) -> bool:
        """One more step of shape ``key`` now, with ``queued`` unfinished (see :meth:`Token2Wav.launch`)?"""
        if queued >= queue_steps:
            return False
        if queued == 0 or queue_s is None:
            return True
        per_step = self.t2w.step_times.estimate(key)
        return per_step is not None and (queued + 1) * per_step <= queue_s

    @torch.inference_mode()
    def advance(self, queue_steps: int | None = None, queue_s: float | None = None) -> bool:
        """Issue more of the batch: Euler steps while fewer than ``queue_steps`` issued steps
        are unfinished on the GPU and, with ``queue_s``, their expected device time stays within
        ``queue_s`` seconds (always at least one; ``queue_steps`` None, or no CUDA stream: all of
        them), then HiFT and the copies. Never waits for the GPU. Returns :attr:`issued`."""
        if self.issued:
            return True
        if self.stream is None:
            queue_steps = None
        key = getattr(self.run, "cost_key", None)  # (None: a run without one is bounded by count only)
        bound = queue_s if queue_steps is not None and key is not None else None  # then its steps are timed
        with self.on_stream():
            while self.run.steps_left and (queue_steps is None
                                           or self._may_queue(self._queued(), queue_steps, bound, key)):
                begin = None
                if bound is not None:
                    begin = torch.cuda.Event(enable_timing=True)
                    begin.record(self.stream)
                self.run.step()
                if queue_steps is not None:
                    end = torch.cuda.Event(enable_timing=begin is not None)
                    end.record(self.stream)
                    self._step_events.append((begin, end))
            if self.run.steps_left:
                return False
            self.t2w._issue_hift(self)
        self.issued = True  # (steps still unfinished report their times in Token2Wav.finish)
        return True

    def done(self) -> bool:
        """Everything issued and finished on the GPU (never blocks)."""
        return self.issued and (self.event is None or self.event.query())


class Token2WavWorker:
    """Runs token2wav batches on a dedicated thread and CUDA stream, one batch at a time.

    Why a thread: launching one batch costs tens of milliseconds of host time (the eager flow
    encoder and HiFT issue hundreds of kernels; HiFT draws its excitation noise on the CPU with
    each request's generator) and finishing it means waiting for the GPU. On the scheduler's
    thread either would pause LM decoding for every stream; here the scheduler only hands the
    batch over (:meth:`submit`) and picks the results up when they are ready (:meth:`poll`).
    PyTorch releases the GIL inside its ops and while waiting on the GPU, so both threads make
    progress. Only this thread touches the flow and HiFT modules (and their CUDA graphs).

    Each result is ``(results, marks)``: per job a :class:`Token2WavResult` or the exception
    that job raised (a failing batch is retried job by job, so one bad request fails alone),
    and the ``(start, flow done, HiFT done)`` timestamps of :meth:`Token2Wav.launch`.
    """

    def __init__(self, t2w: Token2Wav, stream, marks=None):
        from ..models.graphs import shorten_switch_interval

        self.t2w, self.stream, self.marks = t2w, stream, marks
        # each torch op releases and re-takes the GIL; with the default 5 ms switch interval the
        # other thread's Python would hold it for up to 5 ms per op (process-wide setting, kept)
        shorten_switch_interval(2e-4)
        self._in: queue.SimpleQueue = queue.SimpleQueue()
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._busy = False
        self._thread = threading.Thread(target=self._run, name="cosyserve-token2wav", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A batch was submitted and its results not yet taken by :meth:`poll`."""
        return self._busy

    def submit(self, jobs: list[Token2WavJob]) -> None:
        """Start ``jobs`` (raises RuntimeError if a batch is still in flight)."""
        if self._busy:
            raise RuntimeError("a token2wav batch is already in flight")
        self._busy = True
        self._in.put(jobs)

    def poll(self, wait: bool = False):
        """The finished batch's ``(results, marks)``, or None if it is not done (``wait``: block)."""
        if not self._busy:
            return None
        try:
            out = self._out.get(block=wait)
        except queue.Empty:
            return None
        self._busy = False
        return out

    def stop(self) -> None:
        """Ask the thread to exit after the batch in flight (does not wait)."""
        self._in.put(None)

    def close(self) -> None:
        """Stop the thread after the batch in flight and wait for it (idempotent)."""
        if self._thread.is_alive():
            self._in.put(None)
            self._thread.join(30)

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                jobs = self._in.get()
                if jobs is None:
                    return
                try:
                    pending = self.t2w.launch(jobs, stream=self.stream, marks=self.marks)
                    out = (self.t2w.finish(pending), pending.marks)
                except Exception:  # noqa: BLE001 - find the culprit, keep the others
                    out = (self.t2w.run_each(jobs, stream=self.stream), ())
                except BaseException as exc:  # noqa: BLE001 - never leave the scheduler waiting
                    out = ([exc] * len(jobs), ())
                self._out.put(out)
