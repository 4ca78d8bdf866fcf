"""The ``cosyvoice2`` model of the KServe v2 / Triton protocols (shared by HTTP and gRPC).

Interface of CosyVoice's Triton runtime (``runtime/triton_trtllm/model_repo/cosyvoice2``),
so its clients (``client_http.py``, ``client_grpc.py``, ``tritonclient``) work unchanged:

=====================  ========  ========  =====================================================
tensor                 type      shape     meaning
=====================  ========  ========  =====================================================
``reference_wav``      FP32      [1, N]    prompt audio at 16 kHz; may be zero-padded past
                                           ``reference_wav_len`` (optional)
``reference_wav_len``  INT32     [1, 1]    valid samples of ``reference_wav`` (optional; wins)
``reference_text``     BYTES     [1, 1]    transcript of the prompt (with ``reference_wav``)
``target_text``        BYTES     [1, 1]    text to speak (required)
``voice``              BYTES     [1, 1]    cosyserve extension: a registered voice id (optional)
``waveform`` (output)  FP32      [1, M]    24 kHz audio (one response per chunk when streaming)
=====================  ========  ========  =====================================================

Without ``reference_*`` and ``voice``, the server's ``--default-voice`` is used (the Triton
runtime's ``use_spk2info_cache`` behaviour). Optional request parameters (cosyserve
extensions): ``seed`` (int) and ``chunk_policy`` (string).
Every violation raises :class:`~cosyserve.errors.InvalidInputError` naming the tensor.
"""

from __future__ import annotations

import contextlib
import struct
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidInputError
from .state import check_seed

MODEL_VERSION = "1"
PROMPT_SAMPLE_RATE = 16000

INPUTS = (
    ("reference_wav", "FP32", [-1, -1], True),
    ("reference_wav_len", "INT32", [-1, 1], True),
    ("reference_text", "BYTES", [-1, 1], True),
    ("target_text", "BYTES", [-1, 1], False),
    ("voice", "BYTES", [-1, 1], True),
)
OUTPUTS = (("waveform", "FP32", [-1, -1]),)
#: KServe datatype -> little-endian numpy dtype string (HTTP binary and gRPC raw contents)
NUMPY_DTYPES = {"FP32": "<f4", "FP64": "<f8", "INT32": "<i4", "INT64": "<i8", "INT16": "<i2", "INT8": "i1", "UINT8": "u1",
       "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8", "FP16": "<f2", "BOOL": "?"}


def model_metadata(name: str) -> dict:
    """KServe v2 model metadata (JSON form)."""
    return {
        "name": name, "versions": [MODEL_VERSION], "platform": "cosyserve",
        "inputs": [{"name": n, "datatype": t, "shape": s} for n, t, s, _ in INPUTS],
        "outputs": [{"name": n, "datatype": t, "shape": s} for n, t, s in OUTPUTS],
    }


def model_parameters(config) -> dict[str, str]:
    """Server settings published as the model configuration's ``parameters`` (a cosyserve
    extension read by ``cosyserve bench``): token/text ratios and chunk policy."""
    return {"min_token_text_ratio": str(config.min_token_text_ratio),
            "max_token_text_ratio": str(config.max_token_text_ratio),
            "chunk_policy": str(config.chunk_policy)}


def model_config(name: str, max_batch_size: int, parameters: dict[str, str] | None = None) -> dict:
    """Triton model configuration (JSON form of ``config.pbtxt``), decoupled."""
    return {
        "name": name, "platform": "cosyserve", "backend": "cosyserve", "max_batch_size": max_batch_size,
        "parameters": {k: {"string_value": v} for k, v in (parameters or {}).items()},
        "model_transaction_policy": {"decoupled": True},
        "input": [{"name": n, "data_type": "TYPE_" + ("STRING" if t == "BYTES" else t), "dims": [s[1]],
                   "optional": opt} for n, t, s, opt in INPUTS],
        "output": [{"name": n, "data_type": "TYPE_" + t, "dims": [s[1]]} for n, t, s in OUTPUTS],
    }


def decode_bytes_tensor(raw: bytes, count: int, name: str) -> list[bytes]:
    """Triton's BYTES wire format: each element is a 4-byte little-endian length + bytes."""
    out, pos = [], 0
    for _ in range(count):
        if pos + 4 > len(raw):
            raise InvalidInputError(f"input '{name}': BYTES data is truncated", field=name)
        (n,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + n > len(raw):
            raise InvalidInputError(f"input '{name}': BYTES element is truncated", field=name)
        out.append(bytes(raw[pos:pos + n]))
        pos += n
    if pos != len(raw):
        raise InvalidInputError(f"input '{name}': {len(raw) - pos} unexpected trailing bytes", field=name)
    return out


def encode_bytes_tensor(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def decode_raw(name: str, datatype: str, shape: list[int], raw: bytes):
    """Raw tensor bytes (binary extension / gRPC raw contents) -> ndarray or list[bytes]."""
    count = _count(name, shape)
    if datatype == "BYTES":
        return decode_bytes_tensor(raw, count, name)
    if datatype not in NUMPY_DTYPES:
        raise InvalidInputError(f"input '{name}': unsupported datatype {datatype}", field=name)
    dt = np.dtype(NUMPY_DTYPES[datatype])
    if len(raw) != count * dt.itemsize:
        raise InvalidInputError(f"input '{name}': {len(raw)} bytes of data for shape {shape} of {datatype} "
                                f"(expected {count * dt.itemsize})", field=name)
    return np.frombuffer(raw, dtype=dt).reshape(shape)


def decode_json_data(name: str, datatype: str, shape: list[int], data):
    """JSON ``data`` (flat or nested list) -> ndarray or list[bytes]."""
    count = _count(name, shape)
    flat = list(_flatten(data))
    if len(flat) != count:
        raise InvalidInputError(f"input '{name}': {len(flat)} values for shape {shape}", field=name)
    if datatype == "BYTES":
        out = []
        for v in flat:
            if not isinstance(v, str):  # bytes(int) would allocate that many bytes
                raise InvalidInputError(f"input '{name}': BYTES data must be JSON strings, got {type(v).__name__}",
                                        field=name)
            try:
                out.append(v.encode("utf-8"))
            except UnicodeEncodeError:
                raise InvalidInputError(f"input '{name}' is not valid UTF-8 text (unpaired surrogate)",
                                        field=name) from None
        return out
    if datatype not in NUMPY_DTYPES:
        raise InvalidInputError(f"input '{name}': unsupported datatype {datatype}", field=name)
    if any(isinstance(v, (str, bytes, dict, list)) or v is None for v in flat):
        raise InvalidInputError(f"input '{name}': data does not match {datatype} (non-numeric values)", field=name)
    try:
        return np.asarray(flat, dtype=np.dtype(NUMPY_DTYPES[datatype])).reshape(shape)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidInputError(f"input '{name}': data does not match {datatype}: {exc}", field=name) from None


def _flatten(x):
    if isinstance(x, (list, tuple)):
        for v in x:
            yield from _flatten(v)
    else:
        yield x


def _count(name: str, shape) -> int:
    if not isinstance(shape, (list, tuple)) or any(isinstance(s, bool) or not isinstance(s, (int, np.integer))
                                                   for s in shape):
        raise InvalidInputError(f"input '{name}': shape must be a list of integers", field=name)
    shape = [int(s) for s in shape]
    if any(s < 0 for s in shape):
        raise InvalidInputError(f"input '{name}': negative dimension in shape {shape}", field=name)
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass
class KServeTTSRequest:
    """A validated ``cosyvoice2`` request."""

    target_text: str
    reference_wav: np.ndarray | None = None  # float32 [N] at 16 kHz
    reference_text: str | None = None
    voice: str | None = None
    seed: int | None = None
    chunk_policy: str | None = None


def _one_string(name: str, datatype: str, value) -> str:
    if datatype != "BYTES":
        raise InvalidInputError(f"input '{name}' must be BYTES, got {datatype}", field=name)
    if len(value) != 1:
        raise InvalidInputError(f"input '{name}' must hold exactly one string (shape [1, 1]), got {len(value)}",
                                field=name)
    try:
        return value[0].decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInputError(f"input '{name}' is not valid UTF-8", field=name) from None


def parse_request(tensors: dict[str, tuple[str, list[int], object]], parameters: dict | None = None) -> KServeTTSRequest:
    """Validate decoded input tensors ``{name: (datatype, shape, value)}`` of one request."""
    known = {n for n, *_ in INPUTS}
    for name in tensors:
        if name not in known:
            raise InvalidInputError(f"unknown input tensor '{name}'; inputs are {', '.join(sorted(known))}",
                                    field=name)
    for name, (dt, shape, _) in tensors.items():
        if shape and int(shape[0]) != 1:
            raise InvalidInputError(f"input '{name}': batch size must be 1, got shape {list(shape)}", field=name)
    if "target_text" not in tensors:
        raise InvalidInputError("missing required input tensor 'target_text'", field="target_text")
    req = KServeTTSRequest(_one_string("target_text", *_dt_val(tensors["target_text"])))
    if not req.target_text.strip():
        raise InvalidInputError("input 'target_text' is empty", field="target_text")
    if "voice" in tensors:
        req.voice = _one_string("voice", *_dt_val(tensors["voice"]))
    if "reference_wav" in tensors:
        dt, shape, val = tensors["reference_wav"]
        if dt != "FP32":
            raise InvalidInputError(f"input 'reference_wav' must be FP32, got {dt}", field="reference_wav")
        if len(shape) not in (1, 2):
            raise InvalidInputError(f"input 'reference_wav' must have shape [1, N], got {list(shape)}",
                                    field="reference_wav")
        wav = np.asarray(val, dtype=np.float32).reshape(-1)
        if "reference_wav_len" in tensors:
            ldt, lshape, lval = tensors["reference_wav_len"]
            if ldt not in ("INT32", "INT64"):
                raise InvalidInputError(f"input 'reference_wav_len' must be INT32, got {ldt}",
                                        field="reference_wav_len")
            lv = np.asarray(lval).reshape(-1)
            if lv.size != 1:
                raise InvalidInputError("input 'reference_wav_len' must hold one value (shape [1, 1])",
                                        field="reference_wav_len")
            n = int(lv[0])
            if not 0 < n <= wav.size:
                raise InvalidInputError(f"input 'reference_wav_len' = {n} is outside 1..{wav.size}",
                                        field="reference_wav_len")
            wav = wav[:n]
        if wav.size == 0:
            raise InvalidInputError("input 'reference_wav' is empty", field="reference_wav")
        if not np.all(np.isfinite(wav)):
            raise InvalidInputError("input 'reference_wav' contains NaN or infinity", field="reference_wav")
        req.reference_wav = wav
        if "reference_text" not in tensors:
            raise InvalidInputError("input 'reference_text' (the transcript) is required with 'reference_wav'",
                                    field="reference_text")
        req.reference_text = _one_string("reference_text", *_dt_val(tensors["reference_text"]))
        if req.voice is not None:
            raise InvalidInputError("give either 'voice' or 'reference_wav', not both", field="voice")
    elif "reference_text" in tensors or "reference_wav_len" in tensors:
        raise InvalidInputError("'reference_text'/'reference_wav_len' need 'reference_wav'", field="reference_wav")
    p = {} if parameters is None else parameters
    if not isinstance(p, dict):
        raise InvalidInputError("'parameters' must be a JSON object", field="parameters")
    if "seed" in p:
        req.seed = check_seed(p["seed"])
    if "chunk_policy" in p:
        if not isinstance(p["chunk_policy"], str):
            raise InvalidInputError("parameter 'chunk_policy' must be a string", field="chunk_policy")
        req.chunk_policy = p["chunk_policy"]
    return req


def _dt_val(t):
    dt, _shape, val = t
    return dt, val


#: field names of the frontend / voice store -> the ``cosyvoice2`` tensor they come from
_TENSOR_OF_FIELD = {"input": "target_text", "text": "target_text", "prompt_wav": "reference_wav",
                    "prompt_text": "reference_text", "name": "voice", "voice": "voice"}


@contextlib.contextmanager
def tensor_errors():
    """Re-label :class:`InvalidInputError` raised by shared code (frontend, voices) for the
    KServe protocols: the field becomes the input tensor's name (``input`` -> ``target_text``,
    ``prompt_wav`` -> ``reference_wav``, ...) and the message starts with ``input '<tensor>':``,
    so a client sees which tensor was wrong."""
    try:
        yield
    except InvalidInputError as exc:
        tensor = _TENSOR_OF_FIELD.get(exc.field or "", exc.field)
        msg = str(exc)
        if tensor is None or (tensor == exc.field and tensor in msg):
            raise
        if tensor not in msg:
            msg = f"input '{tensor}': {msg}"
        raise type(exc)(msg, field=tensor) from None


async def resolve_voice(state, req: KServeTTSRequest):
    """The voice of a request: its reference audio, a named voice, or the default voice.
    Errors name the tensor (see :func:`tensor_errors`)."""
    with tensor_errors():
        if req.reference_wav is not None:
            return await state.voice_from_audio(req.reference_wav, req.reference_text, PROMPT_SAMPLE_RATE)
        if req.voice is not None:
            return state.get_voice(req.voice)
        return state.default_voice()


async def build_request(state, req: KServeTTSRequest, stream: bool, request_id: str | None = None):
    """The engine request of a validated ``cosyvoice2`` request (errors name the tensor or parameter)."""
    voice = await resolve_voice(state, req)
    params = state.params(seed=req.seed, stream=stream, chunk_policy=req.chunk_policy)
    with tensor_errors():
        return await state.build_request(req.target_text, voice, params, request_id=request_id,
                                         field_name="target_text")
