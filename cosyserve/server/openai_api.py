"""OpenAI-compatible speech API and the voice-management routes.

* ``POST /v1/audio/speech`` — OpenAI's ``audio.speech.create``: ``model``, ``input``,
  ``voice`` (a registered voice id, or ``{"id": ...}`` as OpenAI's custom voices),
  ``response_format`` (``wav``, ``pcm`` = 16-bit LE 24 kHz mono, ``flac``, ``mp3``,
  ``opus``; default ``mp3`` as OpenAI), ``speed`` (0.25-4), ``stream_format`` (``audio``:
  chunked bytes as they are generated; ``sse``: ``speech.audio.delta`` events with base64
  audio, then ``speech.audio.done``). cosyserve extensions: ``seed`` (int) and ``stream``
  (false = synthesize each sentence offline before sending it; default true). ``instructions``:
  CosyVoice3 models only (400 otherwise): upstream ``inference_instruct2``, the instruction
  (ending in ``<|endofprompt|>``, e.g. ``"You are a helpful assistant. 请用广东话表达。<|endofprompt|>"``)
  replaces the voice's LM prompt; the flow keeps the voice's prompt.
* ``GET /v1/models``.
* ``POST /v1/audio/voices`` (multipart ``audio_sample``, ``name``, ``ref_text``),
  ``GET /v1/audio/voices``, ``GET/DELETE /v1/audio/voices/{name}`` — the de-facto voice
  routes of OpenAI-style TTS servers (vLLM-Omni, Kokoro-FastAPI), backed by the voice store.

Errors use OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Literal

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from ..errors import InvalidInputError, VoiceNotFoundError
from ..frontend.voice import validate_voice_id
from .encoding import FORMATS, StreamEncoder
from .state import ServerState, check_text, until_disconnected

router = APIRouter()


class VoiceRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str


class SpeechRequest(BaseModel):
    """Body of ``POST /v1/audio/speech``."""

    model_config = ConfigDict(extra="forbid")
    model: str
    input: str
    voice: str | VoiceRef
    response_format: Literal["mp3", "opus", "flac", "wav", "pcm", "aac"] = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None
    seed: StrictInt | None = None  # not true/false
    stream: bool = True


def _state(request: Request) -> ServerState:
    return request.app.state.cosyserve


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


@router.get("/v1/models")
async def list_models(request: Request):
    st = _state(request)
    now = int(st.started)
    return {"object": "list", "data": [{"id": m, "object": "model", "created": now, "owned_by": "cosyserve"}
                                       for m in st.config.served_models]}


@router.post("/v1/audio/speech")
async def create_speech(body: SpeechRequest, request: Request):
    st = _state(request)
    st.require_ready()
    if body.model not in st.config.served_models:
        return openai_error(404, f"model {body.model!r} is not served here; use one of "
                                 f"{', '.join(st.config.served_models)}", "model", "model_not_found")
    if body.response_format not in FORMATS:
        raise InvalidInputError(f"response_format {body.response_format!r} is not supported; choose one of "
                                f"{', '.join(FORMATS)}", field="response_format")
    cv3 = st.synth.frontend.requires_endofprompt
    if body.instructions and not cv3:
        raise InvalidInputError("'instructions' are not supported by this model; put the style in the voice prompt",
                                field="instructions")
    voice_id = body.voice.id if isinstance(body.voice, VoiceRef) else body.voice
    voice = st.get_voice(voice_id, "voice")
    if body.instructions:  # CosyVoice3: upstream inference_instruct2 (LM prompt = the instruction)
        voice = st.synth.frontend.instruct2_voice(voice, body.instructions)
    params = st.params(seed=body.seed, stream=body.stream, speed=body.speed)
    req = await st.build_request(body.input, voice, params)
    chunks = st.stream("openai", req).__aiter__()
    try:  # errors before any audio become proper status codes; a client that hangs up frees its slot
        first = await until_disconnected(request, chunks.__anext__())
    except BaseException:
        await chunks.aclose()
        raise
    enc = StreamEncoder(body.response_format, first.sample_rate, streaming=True)
    if body.stream_format == "sse":
        return StreamingResponse(_sse(chunks, first, enc, body, req), media_type="text/event-stream",
                                 headers={"X-Request-Id": req.request_id, "Cache-Control": "no-cache"})
    return StreamingResponse(_audio(chunks, first, enc), media_type=enc.media_type,
                             headers={"X-Request-Id": req.request_id})


async def _audio(chunks, first, enc: StreamEncoder):
    try:
        data = enc.push(first.samples)
        if data:
            yield data
        async for ch in chunks:
            data = enc.push(ch.samples)
            if data:
                yield data
        tail = enc.finish()
        if tail:
            yield tail
    finally:
        await chunks.aclose()


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


async def _sse(chunks, first, enc: StreamEncoder, body: SpeechRequest, req):
    n_out = 0
    try:
        pending = [first]
        while True:
            for ch in pending:
                n_out += ch.n_tokens
                data = enc.push(ch.samples)
                if data:
                    yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
            try:
                pending = [await chunks.__anext__()]
            except StopAsyncIteration:
                break
        tail = enc.finish()
        if tail:
            yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(tail).decode()})
        n_in = sum(int(s.numel()) for s in req.segments)
        yield _event({"type": "speech.audio.done",
                      "usage": {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}})
    except Exception as exc:  # mid-stream failure: tell the client in-band
        yield _event({"type": "error", "error": {"message": str(exc), "type": "server_error"}})
    finally:
        await chunks.aclose()


# ---------------------------------------------------------------------------- voices


def _store(st: ServerState):
    if st.voices is None:
        raise InvalidInputError("this server has no voice store (start it with --voices-dir)", field="name")
    return st.voices


@router.post("/v1/audio/voices", status_code=201)
async def create_voice(request: Request, audio_sample: UploadFile = File(...), name: str = Form(...),
                       ref_text: str = Form(...)):
    st = _state(request)
    st.require_ready()
    store = _store(st)
    validate_voice_id(name, "name")
    check_text(ref_text, "ref_text", st.config.max_text_chars)
    if not ref_text.strip():
        raise InvalidInputError("'ref_text' (the transcript of audio_sample) is empty", field="ref_text")
    if name in store:
        return openai_error(409, f"voice {name!r} already exists", "name", "voice_exists")
    limit = st.config.max_upload_bytes
    data = await audio_sample.read(limit + 1)
    if len(data) > limit:
        return openai_error(413, f"audio_sample is larger than {limit} bytes", "audio_sample", "too_large")
    if not data:
        raise InvalidInputError("audio_sample is empty", field="audio_sample")
    import asyncio

    try:
        voice = await asyncio.to_thread(st.synth.make_voice, name, data, ref_text,
                                        {"audio": audio_sample.filename or "", "created": time.time()})
    except InvalidInputError as exc:
        if exc.field == "prompt_wav":
            exc.field = "audio_sample"
        if exc.field == "prompt_text":
            exc.field = "ref_text"
        raise
    store.add(voice)
    return voice.info()


@router.get("/v1/audio/voices")
async def list_voices(request: Request):
    items = _state(request).list_voices()
    return {"object": "list", "data": items, "voices": [v["id"] for v in items]}


@router.get("/v1/audio/voices/{name}")
async def get_voice(name: str, request: Request):
    st = _state(request)
    try:
        return st.get_voice(name, "name").info()
    except VoiceNotFoundError as exc:
        return openai_error(404, str(exc), "name", "voice_not_found")


@router.delete("/v1/audio/voices/{name}")
async def delete_voice(name: str, request: Request):
    st = _state(request)
    store = _store(st)
    validate_voice_id(name, "name")
    if name not in store:
        if st.is_builtin_voice(name):
            return openai_error(400, f"voice {name!r} comes from the model directory and cannot be deleted", "name")
        return openai_error(404, f"unknown voice {name!r}", "name", "voice_not_found")
    store.remove(name)
    return {"id": name, "object": "voice", "deleted": True}
