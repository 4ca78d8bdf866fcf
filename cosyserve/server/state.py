"""What every protocol adapter shares: configuration, models, engine, voices, metrics.

:class:`ServerState` loads the model directory in a worker thread (the process is *live*
at once and *ready* only after the models are loaded and a warm-up request has run; CUDA
graphs are by default captured after that, in the background, while requests are served
eagerly: :class:`~cosyserve.models.graphs.BackgroundCapturer`),
owns the :class:`~cosyserve.engine.async_engine.AsyncEngine` and the voice store, and
offers one instrumented path, :meth:`ServerState.stream`, through which every protocol
runs its requests (metrics, structured logs, outcome accounting). Protocol modules only
translate their wire format to and from these calls.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
import torch

from ..engine.async_engine import AsyncEngine
from ..engine.chunking import ChunkPolicy
from ..engine.core import EngineConfig
from ..engine.gc_pauses import GCPauseMonitor, freeze_heap, freeze_startup_heap
from ..engine.pipeline import DTYPES, Synthesizer
from ..engine.request import AudioChunk, EngineRequest, Outcome, RequestFinished, SynthesisParams
from ..errors import CosyServeError, InvalidInputError, VoiceNotFoundError
from ..frontend.prompt_batch import PromptBatcher
from ..frontend.tokenizer import DEFAULT_INSTRUCTION
from ..frontend.voice import Voice, VoiceStore
from .metrics import Metrics

log = logging.getLogger("cosyserve.server")

#: a full garbage collection longer than this (seconds) while serving freezes its survivors out of later
#: ones (:class:`~cosyserve.engine.gc_pauses.GCPauseMonitor`; at most every 5 minutes): such a pause
#: stalls every stream whose next chunk falls due within it
GC_REFREEZE_S = 0.05

#: ``--admission-calibrate``: the most LM rows the start-up calibration runs at once (the UNet path's first ramp
#: on an H200 ran 30-50 streams, 13-19 of them in the LM at a time: docs/perf.md "Session 41")
CALIBRATION_STREAMS = 48


def _freeze_after_capture() -> None:
    """The background CUDA-graph capture has ended: freeze what it left behind (compiled graphs,
    guards, capture bookkeeping), which full collections would otherwise walk while serving
    (157-165 ms each on the H100 with 128 DiT streams: docs/perf.md "Session 30")."""
    log.info("froze %d objects left by the background graph capture out of garbage collection", freeze_heap())


#: OpenAI model names accepted as aliases of the served model (so stock clients work).
OPENAI_MODEL_ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")

#: accepted request seeds: the int64 range (what torch generators and KServe INT64 parameters hold)
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1


def check_seed(seed, field_name: str = "seed") -> int | None:
    """``seed`` as an int (``None`` stays ``None``); raises :class:`InvalidInputError` naming
    ``field_name`` for a non-integer (bools and fractional floats included) or a value
    outside [``SEED_MIN``, ``SEED_MAX``]."""
    if seed is None:
        return None
    if isinstance(seed, float) and seed.is_integer():
        seed = int(seed)
    elif isinstance(seed, str):
        try:
            seed = int(seed.strip())
        except ValueError:
            raise InvalidInputError(f"'{field_name}' must be an integer, got {seed[:40]!r}", field=field_name) from None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidInputError(f"'{field_name}' must be an integer, got {type(seed).__name__}", field=field_name)
    if not SEED_MIN <= seed <= SEED_MAX:
        raise InvalidInputError(f"'{field_name}' must be within [-2**63, 2**63 - 1], got {seed}", field=field_name)
    return seed


def check_text(text, field_name: str, limit: int) -> str:
    """``text`` if it is a string of at most ``limit`` characters that UTF-8 can encode (no lone
    surrogates, which JSON escapes like ``\\ud800`` produce); else :class:`InvalidInputError`
    naming ``field_name``. Runs before any tokenizer or normaliser sees the text, so an
    over-long text costs nothing."""
    if not isinstance(text, str):
        raise InvalidInputError(f"'{field_name}' must be a string", field=field_name)
    if len(text) > limit:
        raise InvalidInputError(f"'{field_name}' has {len(text)} characters; the limit is {limit} "
                                f"(--max-text-chars)", field=field_name)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"'{field_name}' is not valid Unicode text (unpaired surrogate at character "
                                f"{exc.start})", field=field_name) from None
    if text.strip() and not any(c.isprintable() and not c.isspace() for c in text):
        raise InvalidInputError(f"'{field_name}' has nothing to speak (only control characters)", field=field_name)
    return text


class NotReadyError(CosyServeError):
    """Models are still loading / warming up (HTTP 503, gRPC UNAVAILABLE)."""


class ClientDisconnectedError(CosyServeError):
    """The HTTP client hung up before its response started; its work was cancelled (logged as
    status 499, which nobody receives)."""


async def until_disconnected(request, awaitable):
    """Await ``awaitable`` unless the HTTP client of ``request`` (a Starlette ``Request`` whose
    body has been read) hangs up first: then the work is cancelled (an engine request in it is
    aborted, its slot freed at once) and :class:`ClientDisconnectedError` is raised.

    Starlette notices a disconnect only while a response is being sent; this covers the time
    before the first byte (queueing, prefill, the whole synthesis of an offline request) by
    waiting for the connection's next ASGI message, which after the body can only be
    ``http.disconnect``. (``Request.is_disconnected()`` cannot be used: it polls with an
    already-cancelled scope, which never completes through ``BaseHTTPMiddleware``.)"""
    task = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(request.receive())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        msg = watch.result()
        if msg.get("type") != "http.disconnect":  # not expected after the body: keep working
            return await task
        task.cancel()
        try:
            await task
        except BaseException:  # noqa: BLE001 - the work is abandoned either way
            pass
        raise ClientDisconnectedError("the client disconnected before the response started")
    finally:
        for t in (task, watch):
            if not t.done():  # the watcher after a result; both when we are cancelled ourselves
                t.cancel()


@dataclass
class ServerConfig:
    """``cosyserve serve`` options (see ``cosyserve serve --help``)."""

    model_dir: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 8001
    voices_dir: str | None = None
    default_voice: str | None = None
    #: scheduling limits and options of the engine (``--max-active-streams``, ``--max-queue``, ...)
    engine: EngineConfig = field(default_factory=EngineConfig)
    api_key: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    hift_dtype: str = "auto"
    request_timeout_s: float | None = 300.0
    max_text_chars: int = 4096
    max_upload_bytes: int = 20 * 1024 * 1024
    normalizer: str = "auto"
    chunk_policy: str = "upstream"
    model_name: str = "cosyvoice2"
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0
    warmup: bool = True
    #: ``--admission-calibrate``: after the warm-up, LM-only requests at 1..:data:`CALIBRATION_STREAMS` rows feed
    #: the capacity model's fits of the LM steps alone (:meth:`ServerState._calibrate_admission`)
    admission_calibrate: bool = False
    llm_only: bool = False
    #: ``--llm-only``: the least time between two token events of one streamed completion (seconds; 0:
    #: an event per engine step, tokens already queued gathered; ``--llm-stream-interval``)
    llm_stream_interval_s: float = 0.0
    token2wav_dir: str | None = None  # Step-Audio2 DiT token2wav directory (replaces flow + HiFT)
    #: speech tokenizer backend (``--speech-tokenizer``: auto / torch / onnxruntime)
    tokenizer_backend: str = "auto"
    #: distinct (reference audio, transcript) pairs whose voices are kept (``--prompt-cache``; 0: none)
    prompt_cache_size: int = 64
    #: how long an idle prompt batcher waits for more prompts (``--prompt-batch-window``, seconds)
    prompt_batch_window_s: float = 0.002
    #: the speech LM's completions server (``--llm-url``): this process runs frontend + token2wav
    #: only, speech tokens are streamed from there (:mod:`cosyserve.engine.token_source`)
    llm_url: str | None = None
    llm_model: str | None = None  # its served model name (None: the first of GET /v1/models)
    llm_api_key: str | None = None
    llm_timeout_s: float = 60.0  # the longest wait for the next piece of an LM stream
    #: the convert-llm folder an external LM server serves (``--llm-checkpoint``): its decoder bias is sent
    llm_checkpoint: str | None = None
    #: a second plain-HTTP listener that serves only GET /metrics, without the API key (``--metrics-port``)
    metrics_port: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def served_models(self) -> tuple[str, ...]:
        return (self.model_name,) + OPENAI_MODEL_ALIASES


class ServerState:
    """Models, engine, voices and metrics of one serving process."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.metrics = Metrics()
        self.synth: Synthesizer | None = None
        self.engine: AsyncEngine | None = None
        self.voices = VoiceStore(config.voices_dir) if config.voices_dir else None
        self.ready = False
        self.shutting_down = False
        self.load_error: BaseException | None = None
        self.started = time.time()
        self._voice_cache: OrderedDict[str, Voice] = OrderedDict()
        self._builtin: dict[str, Voice] = {}
        self._warmup_voice_cache: Voice | None = None
        self.stats = {"inference_count": 0, "success": 0, "fail": 0, "success_ns": 0}
        self._gc_monitor: GCPauseMonitor | None = None
        self.prompt_batcher: PromptBatcher | None = None
        #: called with the error once the engine's device context is lost (a sticky CUDA error,
        #: :func:`cosyserve.errors.device_lost`): :func:`cosyserve.server.app.serve` stops and exits non-zero
        self.on_device_lost = None

    # ------------------------------------------------------------------ lifecycle
    def _load_sync(self) -> None:
        c = self.config
        synth = Synthesizer(c.model_dir, device=c.device, dtype=DTYPES[c.dtype], voices_dir=None,
                            normalizer=c.normalizer, max_text_chars=c.max_text_chars, hift_dtype=c.hift_dtype,
                            token2wav_dir=c.token2wav_dir,
                            tokenizer_backend=c.tokenizer_backend, load_llm=c.llm_url is None,
                            load_token2wav=not c.llm_only)
        synth.frontend.warmup()
        self.synth = synth
        md = synth.frontend.model_dir
        if md.spk2info is not None:  # the model directory's own speaker cache, read-only
            try:
                raw = torch.load(md.spk2info, map_location="cpu", weights_only=True)
                for k, v in raw.items():
                    try:
                        self._builtin[str(k)] = Voice.from_spk2info(str(k), v)
                    except CosyServeError as exc:
                        log.warning("skipping speaker %r of %s: %s", k, md.spk2info, exc)
            except Exception as exc:  # noqa: BLE001
                log.warning("cannot read %s: %s", md.spk2info, exc)

    async def start(self) -> None:
        """Load models (in a thread), start the engine, warm up, then mark ready."""
        try:
            await asyncio.to_thread(self._load_sync)
            c = self.config
            self.prompt_batcher = PromptBatcher(self.synth.frontend, window_s=c.prompt_batch_window_s)
            core = await asyncio.to_thread(self._remote_engine) if c.llm_url else \
                self.synth.new_engine(c.engine, observer=self.metrics)
            self.metrics.attach(core)
            # DiT solve graphs for these voices
            if c.token2wav_dir and not c.llm_only and hasattr(core, "plan_stream_prompts"):
                core.plan_stream_prompts(await asyncio.to_thread(self._voice_prompt_tokens))
            self.engine = AsyncEngine(core)
            self.engine.on_device_lost = self._device_lost
            self.engine.start()
            if c.default_voice:
                self.get_voice(c.default_voice)  # fail early on a misconfigured default voice
            if not c.llm_only and getattr(core, "cfg", c.engine).flow_stream_cache == "prefix":
                # (the engine's mode: auto resolved) the known voices' prefixes now, before streams run
                self.engine.prebuild_prompt_prefixes(await asyncio.to_thread(self._prefix_voices))
            if c.warmup:
                await self._warmup()
            frozen = freeze_startup_heap()
            self._gc_monitor = GCPauseMonitor(self.metrics.gc_observed, refreeze_s=GC_REFREEZE_S).install()
            log.info("froze %d start-up objects out of garbage collection", frozen)
            if hasattr(core, "when_graphs_captured"):  # and what the background graph capture leaves behind
                core.when_graphs_captured(_freeze_after_capture)
            self.ready = True
            self.metrics.ready.set(1)
            # with background graph capture the server is ready before its CUDA graphs are: the
            # buckets still pending run eagerly (cosyserve_graphs_pending on /metrics)
            graphs = core.graph_counts() if hasattr(core, "graph_counts") else {"captured": 0, "pending": 0}
            log.info("ready", extra={"event": "ready", "load_s": round(time.time() - self.started, 2),
                                     "device": c.device, "model_dir": str(c.model_dir),
                                     "graphs_captured": int(graphs["captured"]),
                                     "graphs_pending": int(graphs["pending"])})
        except asyncio.CancelledError:  # stopped while loading (SIGTERM, a router's shutdown): not a failure
            log.info("model loading cancelled: the server is stopping")
            raise
        except BaseException as exc:
            self.load_error = exc
            log.error("model loading failed: %s", exc, exc_info=not isinstance(exc, CosyServeError))
            raise

    def _voice_prompt_tokens(self, limit: int = 256) -> list[int]:
        """Flow prompt lengths (tokens) of the voices known at start-up: the model directory's
        speakers and the first ``limit`` registered voices (unreadable files skipped). The engine
        plans the DiT solve graphs it captures before serving for them
        (:meth:`~cosyserve.engine.core.EngineCore.plan_stream_prompts`)."""
        out = [int(v.flow_speech_token.numel()) for v in self._builtin.values()]
        for vid in (self.voices.ids()[:limit] if self.voices is not None else []):
            try:
                out.append(int(self.voices.get(vid).flow_speech_token.numel()))
            except Exception:  # noqa: BLE001 - a corrupt voice file must not stop the server
                continue
        return out

    def _prefix_voices(self, limit: int = 16) -> list[Voice]:
        """The voices whose prompt prefixes are built at start-up (``--flow-stream-cache prefix``; the engine takes
        as many as its pool has slots, in this order): the default voice, the model directory's speakers, then the
        registered voices (unreadable files skipped), at most ``limit``."""
        ids = ([self.config.default_voice] if self.config.default_voice else []) + list(self._builtin)
        ids += self.voices.ids()[:limit] if self.voices is not None else []
        out, seen = [], set()
        for vid in ids:
            if vid in seen or len(out) >= limit:
                continue
            seen.add(vid)
            try:
                out.append(self.get_voice(vid))
            except Exception:  # noqa: BLE001 - a corrupt voice file must not stop the server
                continue
        return out

    def _remote_engine(self):
        """The engine of ``--llm-url``: token2wav here, speech tokens streamed from the LM server
        (its model name resolved now when not given; RemoteLMError if unreachable)."""
        from ..engine.token_source import RemoteLMEngine, remote_source_for

        c = self.config
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per LM stream otherwise
        source = remote_source_for(self.synth.models, len(self.synth.frontend.tokenizer), c.llm_url, c.llm_model,
                                   c.llm_api_key, timeout_s=c.llm_timeout_s, checkpoint=c.llm_checkpoint)
        if c.llm_model is None:
            try:
                source.check()
            except BaseException:
                source.close()
                raise
        return RemoteLMEngine(self.synth.models, source, c.engine, observer=self.metrics)

    async def _warmup_remote(self) -> None:
        """``--llm-url``: warm up once the LM server answers (a worker of a disaggregated router
        may start before its LM server is up): retried every 2 s, logged, until it succeeds."""
        attempt = 0
        while True:
            try:
                return await self._warmup_local()
            except CosyServeError as exc:
                attempt += 1
                if attempt == 1 or attempt % 15 == 0:
                    log.warning("warm-up through the LM server %s failed (%s); retrying", self.config.llm_url, exc)
                await asyncio.sleep(2.0)

    async def _warmup(self) -> None:
        if self.config.llm_url and not self.config.llm_only:
            return await self._warmup_remote()
        return await self._warmup_local()

    async def _warmup_local(self) -> None:
        """One short streaming and one offline request through the whole engine (an LM-only
        request with ``--llm-only``)."""
        if self.config.llm_only:
            ids = self.synth.frontend.token_ids("你好，世界。Hello.")
            req = EngineRequest("warmup-lm", ids[:1], Voice.from_features(
                "warmup", "", torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                torch.zeros(0, 80), torch.zeros(192)), SynthesisParams(seed=0, lm_only=True, min_tokens=4, max_tokens=8))
            async for _ in self.engine.generate(req):
                pass
            return
        voice = await self._warmup_voice()
        for stream in (True, False):
            req = self.synth.build_request("你好，世界。Hello.", voice, SynthesisParams(
                seed=0, stream=stream, min_token_text_ratio=2, max_token_text_ratio=3), "warmup-" + str(stream))
            async for ev in self.engine.generate(req):
                if self.config.llm_url and isinstance(ev, RequestFinished) and ev.error is not None:
                    raise ev.error  # the LM server is not reachable (yet): _warmup_remote retries
        if self.config.admission_calibrate and not self.config.llm_url:
            await self._calibrate_admission(voice)

    async def _warmup_voice(self) -> Voice:
        """The synthetic voice of the warm-up requests (made once: a 2-s pulse train)."""
        if self._warmup_voice_cache is None:
            wav = torch.zeros(1, 24000 * 2)
            wav[0, ::40] = 0.2
            # CosyVoice3 prompt texts carry an instruction ending in <|endofprompt|>
            transcript = (DEFAULT_INSTRUCTION if self.synth.frontend.requires_endofprompt else "") + "你好。"
            self._warmup_voice_cache = await asyncio.to_thread(self.synth.make_voice, "warmup", (wav, 24000),
                                                               transcript)
        return self._warmup_voice_cache

    async def reset_admission(self, calibrate: bool = False) -> dict:
        """``POST /admin/admission/reset``: forget what the capacity model measured (a fresh server's admission,
        :meth:`~cosyserve.engine.core.EngineCore.reset_capacity_model`), then with ``calibrate`` run the start-up
        calibration again (:meth:`_calibrate_admission`; its LM-only requests run beside whatever streams are
        active, whose token2wav then keeps their steps out of the fits of steps alone). Returns ``{"reset": true,
        "calibrated": requests that finished or None}``. Raises InvalidInputError for an engine without a local
        LM (``--llm-url``: its capacity model prices the remote LM's tokens, measured where it runs) and for
        ``calibrate`` on an ``--llm-only`` server (its warm-up voice needs the audio frontend)."""
        if self.config.llm_url or getattr(self.engine.core, "capacity_model", None) is None:
            raise InvalidInputError("this server's engine has no local capacity model to reset", field="reset")
        if calibrate and self.config.llm_only:
            raise InvalidInputError("cannot calibrate an --llm-only server: the calibration runs through the "
                                    "whole model", field="calibrate")
        self.engine.reset_admission()
        done = None
        if calibrate:
            done = await self._calibrate_admission(await self._warmup_voice())
        return {"reset": True, "calibrated": done}

    async def _calibrate_admission(self, voice: Voice) -> int | None:
        """``--admission-calibrate``: up to :data:`CALIBRATION_STREAMS` LM-only requests (at most the engine's
        ``max_active`` and ``max_queue + 1``), request ``i`` generating ``8 + i`` speech tokens, so that the LM
        steps run at every row count from that many down to 1, with no token2wav beside them; the capacity model
        fits them as steps alone only (:meth:`~cosyserve.engine.async_engine.AsyncEngine.calibrate_admission`).
        Logs the fits (event ``admission_calibration``) and returns the requests that finished; a failure is logged
        (None) and the server runs uncalibrated."""
        core = self.engine.core
        model = getattr(core, "capacity_model", None)
        if model is None:
            return None
        n = min(CALIBRATION_STREAMS, core.cfg.max_active, core.cfg.max_queue + 1)  # (all submitted at once)
        t0 = time.perf_counter()
        try:
            reqs = [self.synth.build_request("你好。", voice, SynthesisParams(
                seed=i, stream=False, lm_only=True, min_tokens=8 + i, max_tokens=8 + i), f"calibrate-{i}")
                for i in range(n)]
            ok = await self.engine.calibrate_admission(reqs)
        except CosyServeError as exc:
            log.warning("admission calibration failed (%s); auto admission starts from the warm-up's steps", exc)
            return None
        fits = {name: r.lm_alone.solve() for name, r in (("host", model.host), ("device", model.device))}
        text = ", ".join(f"{k} {v[0] * 1e3:.2f} ms + {v[1] * 1e3:.3f} ms per row"
                         for k, v in fits.items() if v is not None) or "no steps alone"
        log.info("admission calibration: %d of %d LM-only requests in %.2f s; the LM steps alone: %s", ok, n,
                 time.perf_counter() - t0, text,
                 extra={"event": "admission_calibration", "requests": n, "ok": ok,
                        **{f"{k}_alone": None if v is None else [round(v[0], 6), round(v[1], 7)]
                           for k, v in fits.items()}})
        return ok

    def _device_lost(self, exc: BaseException) -> None:
        """The engine's device context is unusable: not ready from now on (health checks and new
        requests see 503), then ``on_device_lost`` (the server process stops and exits non-zero)."""
        self.ready = False
        self.metrics.ready.set(0)
        self.load_error = exc
        if self.on_device_lost is not None:
            self.on_device_lost(exc)

    async def stop(self, drain_timeout: float = 5.0) -> None:
        """Stop accepting requests, let running ones finish for ``drain_timeout`` seconds,
        then end the rest (their streams terminate normally)."""
        if self._gc_monitor is not None:
            self._gc_monitor.uninstall()
        self.shutting_down = True
        self.ready = False
        self.metrics.ready.set(0)
        if self.engine is not None:
            await self.engine.stop(drain_timeout)

    def require_ready(self) -> None:
        if self.shutting_down:
            raise NotReadyError("the server is shutting down")
        if not self.ready:
            if self.load_error is not None:
                raise NotReadyError(f"model failed to load: {self.load_error}")
            raise NotReadyError("the model is still loading")

    # ------------------------------------------------------------------ voices
    def get_voice(self, voice_id: str, field_name: str = "voice") -> Voice:
        """A registered voice (voice store, then the model directory's spk2info.pt)."""
        if self.voices is not None and voice_id in self.voices:
            return self.voices.get(voice_id)
        if voice_id in self._builtin:
            return self._builtin[voice_id]
        raise VoiceNotFoundError(f"unknown voice {voice_id!r}", field=field_name)

    def is_builtin_voice(self, voice_id: str) -> bool:
        """True for speakers of the model directory's ``spk2info.pt`` (read-only voices)."""
        return voice_id in self._builtin

    def default_voice(self) -> Voice:
        if not self.config.default_voice:
            raise InvalidInputError("no reference audio given and the server has no default voice "
                                    "(start it with --default-voice)", field="reference_wav")
        return self.get_voice(self.config.default_voice)

    def list_voices(self) -> list[dict]:
        out = self.voices.list() if self.voices is not None else []
        ids = {v["id"] for v in out}
        out += [{**v.info(), "builtin": True} for k, v in self._builtin.items() if k not in ids]
        return out

    async def voice_from_audio(self, audio, transcript: str, sample_rate: int | None = None) -> Voice:
        """Voice from request audio (bytes, or float32 samples with ``sample_rate``).

        Decoding and features run in a worker thread, the speech tokenizer and CAM++ in batches
        shared with concurrent requests (:class:`~cosyserve.frontend.prompt_batch.PromptBatcher`);
        the last ``prompt_cache_size`` (64) distinct (audio, transcript) pairs are cached, so
        repeated prompts cost nothing.
        """
        self.require_ready()
        h = hashlib.sha256()
        if isinstance(audio, np.ndarray):
            h.update(np.ascontiguousarray(audio, dtype=np.float32).tobytes())
            h.update(str(sample_rate).encode())
        else:
            h.update(bytes(audio))
        check_text(transcript, "prompt_text", self.config.max_text_chars)
        h.update(transcript.encode("utf-8"))
        key = h.hexdigest()
        hit = self._voice_cache.get(key)
        if hit is not None:
            self._voice_cache.move_to_end(key)
            return hit
        src = (torch.from_numpy(np.asarray(audio, dtype=np.float32).reshape(1, -1)), sample_rate) \
            if isinstance(audio, np.ndarray) else bytes(audio)
        voice = await self.prompt_batcher.make_voice("request", src, transcript)
        self._voice_cache[key] = voice
        while len(self._voice_cache) > max(0, self.config.prompt_cache_size):
            self._voice_cache.popitem(last=False)
        return voice

    # ------------------------------------------------------------------ requests
    def params(self, seed: int | None = None, stream: bool = True, speed: float = 1.0,
               chunk_policy: str | None = None) -> SynthesisParams:
        """The engine parameters of a request; raises :class:`InvalidInputError` naming ``seed``
        (see :func:`check_seed`), ``speed`` (not a finite number in 0.25..4) or
        ``chunk_policy`` (not a string :meth:`ChunkPolicy.parse` accepts)."""
        c = self.config
        seed = check_seed(seed)
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0.25 <= speed <= 4.0:
            raise InvalidInputError(f"'speed' must be a number in 0.25..4, got {speed!r}", field="speed")
        if chunk_policy is not None and not isinstance(chunk_policy, str):
            raise InvalidInputError("'chunk_policy' must be a string", field="chunk_policy")
        try:
            policy = ChunkPolicy.parse(chunk_policy or c.chunk_policy)
        except (ValueError, IndexError) as exc:
            raise InvalidInputError(f"'chunk_policy': {exc}", field="chunk_policy") from None
        return SynthesisParams(seed=seed, stream=stream, chunk_policy=policy, speed=speed,
                               min_token_text_ratio=c.min_token_text_ratio,
                               max_token_text_ratio=c.max_token_text_ratio, timeout_s=c.request_timeout_s)

    async def build_request(self, text: str, voice: Voice, params: SynthesisParams,
                            request_id: str | None = None, field_name: str = "input") -> EngineRequest:
        """Normalise and tokenize ``text`` (a worker thread) into an engine request. Raises
        :class:`InvalidInputError` (field ``input``: the frontend's name for the text) for
        text that is not a string, longer than ``--max-text-chars``, not encodable, empty or
        unspeakable; ``field_name`` names the field in the first checks."""
        self.require_ready()
        check_text(text, field_name, self.config.max_text_chars)
        # the engine keys its queues and slots by id: a client's own id (KServe's ``id``, which
        # clients often repeat, e.g. "1" for every request) only prefixes a unique one
        rid = uuid.uuid4().hex if not request_id else f"{request_id}-{uuid.uuid4().hex[:12]}"
        return await asyncio.to_thread(self.synth.build_request, text, voice, params, rid)

    async def stream(self, protocol: str, req: EngineRequest) -> AsyncIterator[AudioChunk]:
        """Run ``req`` on the engine; yield its chunks; record metrics and a log line.

        Raises ``QueueFullError`` at once if the engine is full, and the request's error
        (``InvalidInputError``, ``TimeoutError``, ...) if it fails. Closing the iterator
        early aborts the request.
        """
        self.require_ready()
        t0 = time.monotonic()
        outcome, first, audio_s, finished = "error", None, 0.0, None
        lag0 = None  # the first chunk's delivery lag: later chunks' deadlines count from its hand-over
        self.stats["inference_count"] += 1
        log.info("request", extra={"event": "start", "request_id": req.request_id, "protocol": protocol,
                                   "segments": len(req.segments), "stream": req.params.stream})
        try:
            async for ev in self.engine.generate(req):
                if isinstance(ev, RequestFinished):
                    finished = ev
                    outcome = ev.outcome.value
                    if ev.error is not None:
                        raise ev.error
                    if ev.outcome is Outcome.ABORTED and self.shutting_down:
                        return  # ended by a server shutdown: finish the response cleanly
                    if ev.outcome is not Outcome.OK:
                        raise CosyServeError(f"request {ev.outcome.value}")
                    continue
                now = time.monotonic()
                if first is None:
                    first = now - req.arrival
                if ev.emitted_at is not None and req.params.stream:
                    lag = now - ev.emitted_at
                    self.metrics.delivery_lag.observe(lag)
                    if lag0 is None:
                        lag0 = lag
                    elif ev.slack_s is not None:  # as the client sees it: later by what this chunk lost more
                        self.engine.core.observe_delivered_slack(ev.slack_s - (lag - lag0))
                audio_s += ev.duration_s
                yield ev
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            total = time.monotonic() - t0
            self.metrics.record(protocol, outcome, first, total, audio_s)
            if outcome == "ok":
                self.stats["success"] += 1
                self.stats["success_ns"] += int(total * 1e9)
            else:
                self.stats["fail"] += 1
            phases = (finished.first_chunk_breakdown if finished else None) or {}
            log.info("request", extra={
                "event": "finish", "request_id": req.request_id, "protocol": protocol, "outcome": outcome,
                "first_chunk_ms": None if first is None else round(first * 1000, 1),
                # where the first chunk's time went (engine phases, benchmarks/first_chunk_tail.py)
                **{f"first_chunk_{k}_ms": round(v * 1000, 1) for k, v in phases.items()},
                "total_ms": round(total * 1000, 1), "audio_s": round(audio_s, 3),
                "rtf": round(total / audio_s, 4) if audio_s else None,
                "seed": finished.seed if finished else req.params.seed,
                "tokens": finished.n_tokens if finished else None})


class JsonFormatter(logging.Formatter):
    """One JSON object per log line, with the ``extra`` fields (request_id, ...)."""

    _skip = set(logging.LogRecord("x", 0, "x", 0, "x", None, None).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        d = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
             "msg": record.getMessage()}
        d.update({k: v for k, v in record.__dict__.items() if k not in self._skip})
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        return json.dumps(d, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """Human-readable lines with the structured fields appended as key=value."""

    _skip = JsonFormatter._skip

    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extra = " ".join(f"{k}={v}" for k, v in record.__dict__.items() if k not in self._skip)
        return f"{base} {extra}" if extra else base


def setup_logging(fmt: str = "text", level: int = logging.INFO) -> None:
    """The root logger's one handler: records to ``sys.stderr`` as text or JSON lines (``fmt``)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
