"""One TTS request over one protocol, timed chunk by chunk: the measuring core of
``cosyserve bench`` and ``cosyserve client``.

Each :class:`Runner` is used by one thread at a time and sends requests one after the
other through its own connection (a benchmark client). ``run(spec)`` returns a
:class:`Trace`: when the request was sent and when each piece of audio arrived (clock:
``time.perf_counter()``, seconds), with its number of samples.

==========  ==========  =====================================================================
protocol    mode        what is sent / what counts as a chunk
==========  ==========  =====================================================================
grpc        streaming   KServe v2 / Triton ``ModelStreamInfer`` (``tritonclient.grpc``
                        ``start_stream`` + ``async_stream_infer`` with an empty final
                        response, as CosyVoice's ``client_grpc.py``); one response = a chunk
grpc        offline     ``ModelInfer``; the whole waveform is one chunk
http        offline     KServe v2 HTTP infer (``tritonclient.http``, binary tensors); one chunk
openai      streaming   ``POST /v1/audio/speech`` (``response_format=pcm``, ``stream: true``)
                        read as it arrives (``httpx``); network reads closer together than
                        :data:`COALESCE_S` form one chunk (a large chunk may need several reads)
openai      offline     the same with ``stream: false``; the complete response is one chunk
in-process  both        :class:`~cosyserve.engine.async_engine.AsyncEngine` in this process,
                        through the same steps as the server (voice from the prompt, cached;
                        text normalisation; engine); an engine chunk is a chunk (offline: the
                        finished waveform)
==========  ==========  =====================================================================

The reference audio travels with every request (KServe ``reference_wav`` at 16 kHz plus
``reference_text``) unless a registered voice id is given (KServe ``voice`` tensor, OpenAI
``voice`` field). The OpenAI speech API has no audio input, so for it the prompts are
registered once through cosyserve's ``POST /v1/audio/voices`` (:func:`register_openai_voices`).
"""

from __future__ import annotations

import asyncio
import hashlib
import queue
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import numpy as np

from ..errors import CosyServeError

PCM_SAMPLE_RATE = 24000  # OpenAI's "pcm": 16-bit little-endian mono at 24 kHz
COALESCE_S = 0.005
PROTOCOLS = ("grpc", "http", "openai")
MODES = ("streaming", "offline")


class ClientError(CosyServeError):
    """Bad client configuration (URL, protocol/mode combination, ...)."""


@dataclass
class RequestSpec:
    """What to synthesize: ``text`` with either ``voice`` (a registered id) or the prompt
    (``prompt_16k`` float32 ``[N]`` at 16 kHz + ``prompt_text``). ``item_id`` names the
    prompt for caches (the OpenAI voice registry, the in-process voice cache)."""

    request_id: str
    text: str
    seed: int | None = None
    voice: str | None = None
    prompt_16k: np.ndarray | None = None
    prompt_text: str | None = None
    item_id: str = ""
    chunk_policy: str | None = None  # KServe gRPC request parameter (cosyserve extension)


@dataclass
class Trace:
    """Timing of one request (``perf_counter`` seconds) and its audio.

    ``arrivals``: ``(time, samples)`` per chunk; ``t_end``: when the response was complete;
    ``audio``: the samples (float32, only when the runner keeps audio).
    """

    t_send: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    t_end: float | None = None
    sample_rate: int = PCM_SAMPLE_RATE
    error: str | None = None
    audio: list[np.ndarray] | None = None

    @property
    def samples(self) -> int:
        return sum(n for _, n in self.arrivals)

    def waveform(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32)


def parse_url(url: str, protocol: str) -> tuple[str, str]:
    """``(scheme, host:port)`` of ``--url``; grpc needs ``grpc://``, http/openai ``http(s)://``."""
    u = urlparse(url if "://" in url else ("grpc://" if protocol == "grpc" else "http://") + url)
    if not u.hostname or not u.port:
        raise ClientError(f"--url must look like grpc://HOST:PORT or http://HOST:PORT, got {url!r}")
    want = ("grpc",) if protocol == "grpc" else ("http", "https")
    if u.scheme not in want:
        raise ClientError(f"--protocol {protocol} needs a {want[0]}:// URL, got {url!r}")
    return u.scheme, f"{u.hostname}:{u.port}"


def check_combination(protocol: str, mode: str) -> None:
    if protocol not in PROTOCOLS:
        raise ClientError(f"unknown protocol {protocol!r} (grpc, http, openai)")
    if mode not in MODES:
        raise ClientError(f"unknown mode {mode!r} (streaming, offline)")
    if protocol == "http" and mode == "streaming":
        raise ClientError("KServe v2 HTTP has no streaming inference: use --mode offline with --protocol http, "
                          "or --protocol grpc / openai for streaming")


def _auth(api_key: str | None) -> dict:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


#: the model name a client uses when the server does not say (older servers, errors)
DEFAULT_MODEL_NAME = "cosyvoice2"


def served_model_name(protocol: str, scheme: str, addr: str, api_key: str | None = None,
                      timeout_s: float = 10.0) -> str:
    """The name of the model the server at ``addr`` serves (``cosyvoice2``, ``cosyvoice3`` or its
    ``serve --model-name``), asked the protocol's way: OpenAI ``GET /v1/models`` (the first is the
    server's own name, OpenAI's TTS names follow), KServe HTTP ``GET /v2/models/stats``, gRPC
    ``ModelStatistics`` of every model. :data:`DEFAULT_MODEL_NAME` if the server does not answer
    (the request itself then reports why)."""
    try:
        if protocol == "grpc":
            import tritonclient.grpc as tg

            cl = tg.InferenceServerClient(addr)
            try:
                stats = cl.get_inference_statistics("", headers=_auth(api_key), as_json=True,
                                                    client_timeout=timeout_s)
            finally:
                cl.close()
            return str(stats["model_stats"][0]["name"])
        import httpx

        if protocol == "openai":
            r = httpx.get(f"{scheme}://{addr}/v1/models", headers=_auth(api_key), timeout=timeout_s)
            r.raise_for_status()
            return str(r.json()["data"][0]["id"])
        r = httpx.get(f"{scheme}://{addr}/v2/models/stats", headers=_auth(api_key), timeout=timeout_s)
        r.raise_for_status()
        return str(r.json()["model_stats"][0]["name"])
    except Exception:  # noqa: BLE001 - discovery only: the request reports an unreachable server
        return DEFAULT_MODEL_NAME


class Runner:
    """Sends one request at a time; subclasses implement :meth:`run`."""

    keep_audio: bool = False

    def run(self, spec: RequestSpec) -> Trace:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        pass

    def _add(self, tr: Trace, t: float, samples: np.ndarray) -> None:
        tr.arrivals.append((t, int(samples.size)))
        if self.keep_audio:
            tr.audio = (tr.audio or []) + [np.asarray(samples, dtype=np.float32).reshape(-1)]


# ---------------------------------------------------------------------------- KServe v2


def kserve_inputs(mod, spec: RequestSpec) -> list:
    """``tritonclient`` inputs of the ``cosyvoice2`` model for ``spec``."""
    inputs = []
    if spec.voice is not None:
        v = mod.InferInput("voice", [1, 1], "BYTES")
        v.set_data_from_numpy(np.array([[spec.voice]], dtype=object))
        inputs.append(v)
    elif spec.prompt_16k is not None:
        wav = np.ascontiguousarray(spec.prompt_16k.reshape(1, -1), dtype=np.float32)
        a = mod.InferInput("reference_wav", list(wav.shape), "FP32")
        a.set_data_from_numpy(wav)
        n = mod.InferInput("reference_wav_len", [1, 1], "INT32")
        n.set_data_from_numpy(np.array([[wav.shape[1]]], dtype=np.int32))
        t = mod.InferInput("reference_text", [1, 1], "BYTES")
        t.set_data_from_numpy(np.array([[spec.prompt_text or ""]], dtype=object))
        inputs += [a, n, t]
    target = mod.InferInput("target_text", [1, 1], "BYTES")
    target.set_data_from_numpy(np.array([[spec.text]], dtype=object))
    return inputs + [target]


def _params(spec: RequestSpec) -> dict | None:
    p = {}
    if spec.seed is not None:
        p["seed"] = int(spec.seed)
    if spec.chunk_policy:
        p["chunk_policy"] = spec.chunk_policy
    return p or None


class GrpcStreamRunner(Runner):
    """Triton decoupled streaming over one gRPC stream (``client_grpc.py``'s pattern)."""

    def __init__(self, addr: str, model: str = "cosyvoice2", api_key: str | None = None, timeout_s: float = 600.0):
        import tritonclient.grpc as tg

        self.tg, self.addr, self.model, self.timeout_s = tg, addr, model, timeout_s
        self.headers = _auth(api_key) or None
        self.client = tg.InferenceServerClient(addr)
        self._q: queue.Queue = queue.Queue()
        self._open()

    def _open(self) -> None:
        self.client.start_stream(callback=self._callback, headers=self.headers)

    def _callback(self, result, error) -> None:
        self._q.put((time.perf_counter(), result, error))

    def run(self, spec: RequestSpec) -> Trace:
        inputs = kserve_inputs(self.tg, spec)
        outputs = [self.tg.InferRequestedOutput("waveform")]
        stale_error = None
        while not self._q.empty():  # leftovers of an earlier, failed request (or of a broken stream)
            _, _, err = self._q.get_nowait()
            stale_error = str(err) if err is not None else stale_error
        tr = Trace(time.perf_counter(), sample_rate=PCM_SAMPLE_RATE)
        try:
            self.client.async_stream_infer(self.model, inputs, request_id=spec.request_id, outputs=outputs,
                                           parameters=_params(spec), enable_empty_final_response=True)
            deadline = tr.t_send + self.timeout_s
            while True:
                t, result, error = self._q.get(timeout=max(0.01, deadline - time.perf_counter()))
                if error is not None:
                    tr.error = str(error)
                    return tr
                resp = result.get_response()
                if resp.id != spec.request_id:
                    continue
                if resp.outputs:
                    self._add(tr, t, result.as_numpy("waveform").reshape(-1))
                if resp.parameters["triton_final_response"].bool_param:
                    tr.t_end = t
                    return tr
        except queue.Empty:
            tr.error = f"no response within {self.timeout_s} s"
            self._restart()
        except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
            tr.error = self._callback_error() or stale_error or f"{type(exc).__name__}: {exc}"
            self._restart()
        return tr

    def _callback_error(self) -> str | None:
        """The error the stream's callback reported, if any (it explains a broken stream)."""
        deadline = time.perf_counter() + 0.5
        while time.perf_counter() < deadline:
            try:
                _, _, error = self._q.get(timeout=0.05)
            except queue.Empty:
                continue
            if error is not None:
                return str(error)
        return None

    def _restart(self) -> None:
        try:
            self.client.stop_stream(cancel_requests=True)
        except Exception:  # noqa: BLE001
            pass
        self._q = queue.Queue()
        try:
            self._open()
        except Exception:  # noqa: BLE001 - the next request reports the broken stream
            pass

    def close(self) -> None:
        try:
            self.client.stop_stream()
            self.client.close()
        except Exception:  # noqa: BLE001
            pass


class KServeOfflineRunner(Runner):
    """``ModelInfer`` over gRPC or the KServe v2 HTTP infer route (the whole waveform at once)."""

    def __init__(self, protocol: str, addr: str, model: str = "cosyvoice2", api_key: str | None = None,
                 timeout_s: float = 600.0, ssl: bool = False):
        self.protocol, self.model, self.timeout_s = protocol, model, timeout_s
        self.headers = _auth(api_key) or None
        if protocol == "grpc":
            import tritonclient.grpc as mod

            self.client = mod.InferenceServerClient(addr)
        else:
            import tritonclient.http as mod

            self.client = mod.InferenceServerClient(addr, ssl=ssl, connection_timeout=timeout_s,
                                                    network_timeout=timeout_s)
        self.mod = mod

    def run(self, spec: RequestSpec) -> Trace:
        inputs = kserve_inputs(self.mod, spec)
        if self.protocol == "grpc":
            outputs = [self.mod.InferRequestedOutput("waveform")]
            kw = {"client_timeout": self.timeout_s}
        else:
            outputs = [self.mod.InferRequestedOutput("waveform", binary_data=True)]
            kw = {}
        tr = Trace(time.perf_counter(), sample_rate=PCM_SAMPLE_RATE)
        try:
            res = self.client.infer(self.model, inputs, outputs=outputs, request_id=spec.request_id,
                                    parameters=_params(spec), headers=self.headers, **kw)
            t = time.perf_counter()
            wav = res.as_numpy("waveform")
            if wav is None:
                raise ClientError("the response has no 'waveform' output")
            self._add(tr, t, wav.reshape(-1))
            tr.t_end = t
        except Exception as exc:  # noqa: BLE001
            tr.error = f"{type(exc).__name__}: {exc}"
        return tr

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001
            pass


# ---------------------------------------------------------------------------- OpenAI


class OpenAIRunner(Runner):
    """``POST /v1/audio/speech`` with ``response_format=pcm`` (see module docstring)."""

    def __init__(self, base_url: str, streaming: bool, model: str = "cosyvoice2", api_key: str | None = None,
                 timeout_s: float = 600.0):
        import httpx

        self.streaming, self.model = streaming, model
        self.http = httpx.Client(base_url=base_url, timeout=timeout_s, headers=_auth(api_key))
        self._httpx = httpx

    def body(self, spec: RequestSpec) -> dict:
        if spec.voice is None:
            raise ClientError("the OpenAI protocol needs a registered voice (see register_openai_voices)")
        b = {"model": self.model, "input": spec.text, "voice": spec.voice, "response_format": "pcm",
             "stream": self.streaming}
        if spec.seed is not None:
            b["seed"] = int(spec.seed)
        return b

    def run(self, spec: RequestSpec) -> Trace:
        body = self.body(spec)
        tr = Trace(time.perf_counter(), sample_rate=PCM_SAMPLE_RATE)
        try:
            if not self.streaming:
                r = self.http.post("/v1/audio/speech", json=body)
                t = time.perf_counter()
                if r.status_code != 200:
                    tr.error = f"HTTP {r.status_code}: {r.text[:300]}"
                    return tr
                self._add(tr, t, _pcm16(r.content))
                tr.t_end = t
                return tr
            with self.http.stream("POST", "/v1/audio/speech", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    tr.error = f"HTTP {r.status_code}: {r.text[:300]}"
                    return tr
                pending = b""       # bytes of an odd trailing half-sample
                chunk: list[bytes] = []
                last = None
                for data in r.iter_raw():
                    t = time.perf_counter()
                    if last is not None and t - last > COALESCE_S and chunk:
                        pending = self._flush(tr, last, pending, chunk)
                        chunk = []
                    chunk.append(data)
                    last = t
                if chunk:
                    pending = self._flush(tr, last, pending, chunk)
                tr.t_end = time.perf_counter()
                if pending:
                    tr.error = "the PCM stream ended in the middle of a sample"
        except self._httpx.HTTPError as exc:
            tr.error = f"{type(exc).__name__}: {exc}"
        return tr

    def _flush(self, tr: Trace, t: float, pending: bytes, parts: list[bytes]) -> bytes:
        data = pending + b"".join(parts)
        n = len(data) // 2 * 2
        self._add(tr, t, _pcm16(data[:n]))
        return data[n:]

    def close(self) -> None:
        self.http.close()


def _pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data[: len(data) // 2 * 2], dtype="<i2").astype(np.float32) / 32767.0


def voice_name_for(item_id: str, wav_bytes: bytes, text: str) -> str:
    """Stable voice id for a prompt (same audio + transcript -> same id)."""
    h = hashlib.sha1(wav_bytes + text.encode("utf-8")).hexdigest()[:10]
    safe = "".join(c if c.isalnum() or c in "_.-" else "-" for c in item_id)[:40]
    return f"bench-{safe}-{h}"


def register_openai_voices(base_url: str, prompts: dict[str, tuple[bytes, str]], api_key: str | None = None,
                           timeout_s: float = 120.0) -> tuple[dict[str, str], list[str]]:
    """Register each prompt (``{key: (wav file bytes, transcript)}``) as a voice through
    ``POST /v1/audio/voices``; returns ``({key: voice id}, ids created now)``. A voice that
    already exists under the same content-derived id is reused. Raises :class:`ClientError`
    when the server has no voice routes or refuses a prompt."""
    import httpx

    out, created = {}, []
    with httpx.Client(base_url=base_url, timeout=timeout_s, headers=_auth(api_key)) as http:
        for key, (data, text) in prompts.items():
            name = voice_name_for(key, data, text)
            r = http.post("/v1/audio/voices", files={"audio_sample": ("prompt.wav", data, "audio/wav")},
                          data={"name": name, "ref_text": text})
            if r.status_code == 201:
                created.append(name)
            elif r.status_code != 409:
                raise ClientError(f"cannot register the prompt of {key!r} as a voice (POST /v1/audio/voices: HTTP "
                                  f"{r.status_code} {r.text[:200]}); give --voice ID for the OpenAI protocol")
            out[key] = name
    return out, created


def delete_openai_voices(base_url: str, names: list[str], api_key: str | None = None) -> None:
    """Remove voices created by :func:`register_openai_voices` (errors are ignored)."""
    import httpx

    with httpx.Client(base_url=base_url, timeout=30, headers=_auth(api_key)) as http:
        for n in names:
            try:
                http.delete(f"/v1/audio/voices/{n}")
            except httpx.HTTPError:
                pass


# ---------------------------------------------------------------------------- in-process


class InProcessEngine:
    """A :class:`~cosyserve.engine.pipeline.Synthesizer` + :class:`AsyncEngine` running on an
    event loop in a background thread, shared by :class:`InProcessRunner` threads.

    ``params``: a function ``(seed, stream) -> SynthesisParams``. ``voices``: optional
    :class:`~cosyserve.frontend.voice.VoiceStore` for ``RequestSpec.voice``.
    """

    def __init__(self, synth, engine_config, params, voices=None, builtin_voices: dict | None = None):
        from ..engine.async_engine import AsyncEngine

        self.synth, self.params, self.voices = synth, params, voices
        self.builtin = dict(builtin_voices or {})
        self._voice_cache: dict = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cosyserve-bench-loop", daemon=True)
        self._thread.start()
        from .breakdown import EngineCounters

        self.counters = EngineCounters()  # stage times and first-chunk phases (the engine's observer)
        self.engine = AsyncEngine(synth.new_engine(engine_config, observer=self.counters))
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()

    async def _start(self) -> None:
        self.engine.start()

    def submit(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def voice_for(self, spec: RequestSpec):
        if spec.voice is not None:
            if spec.voice in self.builtin:
                return self.builtin[spec.voice]
            if self.voices is None:
                raise ClientError(f"unknown voice {spec.voice!r} (no voice store)")
            return self.voices.get(spec.voice)
        key = (spec.item_id, spec.prompt_text, hashlib.sha1(spec.prompt_16k.tobytes()).hexdigest())
        v = self._voice_cache.get(key)
        if v is None:  # as the server: features computed once per distinct prompt, in a worker thread
            import torch

            wav = torch.from_numpy(np.ascontiguousarray(spec.prompt_16k, dtype=np.float32)).reshape(1, -1)
            v = await asyncio.to_thread(self.synth.make_voice, "bench", (wav, 16000), spec.prompt_text)
            self._voice_cache[key] = v
        return v

    def close(self) -> None:
        try:
            self.submit(self.engine.stop(), timeout=60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


class InProcessRunner(Runner):
    """Requests on a shared :class:`InProcessEngine` (no network, no encoding)."""

    def __init__(self, shared: InProcessEngine, streaming: bool, timeout_s: float = 600.0):
        self.shared, self.streaming, self.timeout_s = shared, streaming, timeout_s

    async def _run(self, spec: RequestSpec, tr: Trace) -> None:
        from ..engine.request import AudioChunk, RequestFinished

        sh = self.shared
        voice = await sh.voice_for(spec)
        req = await asyncio.to_thread(sh.synth.build_request, spec.text, voice,
                                      sh.params(spec.seed, self.streaming), spec.request_id)
        pieces: list[np.ndarray] = []
        async for ev in sh.engine.generate(req):
            t = time.perf_counter()
            if isinstance(ev, AudioChunk):
                tr.sample_rate = ev.sample_rate
                if self.streaming:
                    self._add(tr, t, ev.samples)
                else:
                    pieces.append(ev.samples)
            elif isinstance(ev, RequestFinished):
                if ev.error is not None or ev.outcome.value != "ok":
                    tr.error = str(ev.error or ev.outcome.value)
                    return
                if not self.streaming:
                    self._add(tr, t, np.concatenate(pieces) if pieces else np.zeros(0, np.float32))
                tr.t_end = t

    def run(self, spec: RequestSpec) -> Trace:
        tr = Trace(time.perf_counter())
        try:
            self.shared.submit(self._run(spec, tr), timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001
            tr.error = f"{type(exc).__name__}: {exc}"
        return tr
