"""KServe v2 / Triton HTTP protocol (same port as the OpenAI API).

Routes: ``/v2/health/live``, ``/v2/health/ready``, ``/v2``, ``/v2/models/{name}``,
``/v2/models/{name}/ready``, ``/v2/models/{name}/config``, ``/v2/models[/{name}]/stats``,
``POST /v2/models/{name}[/versions/1]/infer`` (the whole waveform in one response).
Requests may use JSON tensor data or the binary tensor data extension
(``Inference-Header-Content-Length``), as ``tritonclient.http`` does; outputs are
returned in binary when the request asks for it (``"binary_data": true``), else as JSON.
Errors: ``{"error": "..."}`` with a 4xx status naming the tensor.
"""

from __future__ import annotations

import json

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from .. import __version__
from ..errors import InvalidInputError
from .kserve_common import (
    MODEL_VERSION,
    decode_json_data,
    decode_raw,
    model_config,
    model_metadata,
    model_parameters,
    build_request,
    parse_request,
)
from .state import ServerState, until_disconnected


async def _collect(chunks) -> list[np.ndarray]:
    return [ch.samples async for ch in chunks]

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.cosyserve


def kserve_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _check_model(st: ServerState, name: str, version: str | None = None) -> JSONResponse | None:
    if name != st.config.model_name:
        return kserve_error(404, f"unknown model '{name}' (this server serves '{st.config.model_name}')")
    if version not in (None, "", MODEL_VERSION):
        return kserve_error(404, f"unknown version '{version}' of model '{name}' (available: {MODEL_VERSION})")
    return None


@router.get("/v2/health/live")
async def live():
    return Response(status_code=200)


@router.get("/v2/health/ready")
async def ready(request: Request):
    return Response(status_code=200 if _state(request).ready else 503)


@router.get("/v2")
async def server_metadata():
    return {"name": "cosyserve", "version": __version__,
            "extensions": ["binary_tensor_data", "statistics", "model_configuration"]}


def statistics(st: ServerState) -> dict:
    s = st.stats
    return {"model_stats": [{
        "name": st.config.model_name, "version": MODEL_VERSION, "last_inference": 0,
        "inference_count": s["inference_count"], "execution_count": s["inference_count"],
        "inference_stats": {"success": {"count": s["success"], "ns": s["success_ns"]},
                            "fail": {"count": s["fail"], "ns": 0}, "queue": {"count": 0, "ns": 0},
                            "compute_input": {"count": 0, "ns": 0}, "compute_infer": {"count": 0, "ns": 0},
                            "compute_output": {"count": 0, "ns": 0}},
        "batch_stats": []}]}


# registered before /v2/models/{name}, which would otherwise take "stats" for a model name
@router.get("/v2/models/stats")
@router.get("/v2/models/{name}/stats")
@router.get("/v2/models/{name}/versions/{version}/stats")
async def get_stats(request: Request, name: str | None = None, version: str | None = None):
    st = _state(request)
    if name is not None:
        err = _check_model(st, name, version)
        if err is not None:
            return err
    return statistics(st)


@router.get("/v2/models/{name}")
@router.get("/v2/models/{name}/versions/{version}")
async def get_model(name: str, request: Request, version: str | None = None):
    st = _state(request)
    return _check_model(st, name, version) or model_metadata(name)


@router.get("/v2/models/{name}/ready")
@router.get("/v2/models/{name}/versions/{version}/ready")
async def model_ready(name: str, request: Request, version: str | None = None):
    st = _state(request)
    return _check_model(st, name, version) or Response(status_code=200 if st.ready else 503)


@router.get("/v2/models/{name}/config")
@router.get("/v2/models/{name}/versions/{version}/config")
async def get_config(name: str, request: Request, version: str | None = None):
    st = _state(request)
    return _check_model(st, name, version) or model_config(name, st.config.engine.max_active,
                                                            model_parameters(st.config))


def parse_body(body: bytes, header_length: str | None) -> tuple[dict, dict]:
    """Split a KServe v2 HTTP request into its JSON header and decoded tensors."""
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise InvalidInputError("Inference-Header-Content-Length is not an integer", field="headers") from None
        if not 0 <= n <= len(body):
            raise InvalidInputError("Inference-Header-Content-Length exceeds the request body", field="headers")
        head, binary = body[:n], body[n:]
    else:
        head, binary = body, b""
    try:
        doc = json.loads(head)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"request body is not valid JSON: {exc}", field="body") from None
    except RecursionError:
        raise InvalidInputError("request body is not valid JSON: nested too deeply", field="body") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
        raise InvalidInputError("request must be a JSON object with an 'inputs' list", field="inputs")
    tensors, pos = {}, 0
    for t in doc["inputs"]:
        if not isinstance(t, dict) or not {"name", "datatype", "shape"} <= set(t):
            raise InvalidInputError("each element of 'inputs' must be an object with 'name', 'datatype' and 'shape'",
                                    field="inputs")
        name, dt, shape = str(t["name"]), str(t["datatype"]), t["shape"]
        if not isinstance(shape, list):
            raise InvalidInputError(f"input '{name}': shape must be a list", field=name)
        params = t.get("parameters")
        params = {} if params is None else params
        if not isinstance(params, dict):
            raise InvalidInputError(f"input '{name}': 'parameters' must be a JSON object", field=name)
        if "binary_data_size" in params:
            size = params["binary_data_size"]
            if isinstance(size, bool) or not isinstance(size, int):
                raise InvalidInputError(f"input '{name}': binary_data_size must be an integer", field=name)
            if size < 0 or pos + size > len(binary):
                raise InvalidInputError(f"input '{name}': binary_data_size exceeds the binary payload", field=name)
            value = decode_raw(name, dt, shape, binary[pos:pos + size])
            pos += size
        elif "data" in t:
            if not isinstance(t["data"], list):
                raise InvalidInputError(f"input '{name}': 'data' must be a JSON array", field=name)
            value = decode_json_data(name, dt, shape, t["data"])
        else:
            raise InvalidInputError(f"input '{name}' has neither 'data' nor binary data", field=name)
        if name in tensors:
            raise InvalidInputError(f"input '{name}' is given twice", field=name)
        tensors[name] = (dt, shape, value)
    if pos != len(binary):
        raise InvalidInputError(f"{len(binary) - pos} bytes of binary data after the last input's binary_data_size",
                                field="binary")
    outputs = doc.get("outputs")
    if outputs is not None and (not isinstance(outputs, list) or not all(isinstance(o, dict) for o in outputs)):
        raise InvalidInputError("'outputs' must be a list of objects", field="outputs")
    for o in outputs or []:
        if o.get("name") != "waveform":
            raise InvalidInputError(f"'outputs' names an unknown output '{o.get('name')}'; the only output is "
                                    f"'waveform'", field="outputs")
        if not isinstance(o.get("parameters") or {}, dict):
            raise InvalidInputError("output 'waveform': 'parameters' must be a JSON object", field="outputs")
    if not isinstance(doc.get("parameters") or {}, dict):
        raise InvalidInputError("'parameters' must be a JSON object", field="parameters")
    return doc, tensors


@router.post("/v2/models/{name}/infer")
@router.post("/v2/models/{name}/versions/{version}/infer")
async def infer(name: str, request: Request, version: str | None = None):
    st = _state(request)
    err = _check_model(st, name, version)
    if err is not None:
        return err
    st.require_ready()
    doc, tensors = parse_body(await request.body(), request.headers.get("Inference-Header-Content-Length"))
    req = parse_request(tensors, doc.get("parameters"))
    ereq = await build_request(st, req, stream=False)
    pieces = await until_disconnected(request, _collect(st.stream("kserve_http", ereq)))
    wav = np.concatenate(pieces).astype("<f4") if pieces else np.zeros(0, "<f4")

    outputs = doc.get("outputs") or [{"name": "waveform"}]
    binary = bool((outputs[0].get("parameters") or {}).get("binary_data")) or \
        bool((doc.get("parameters") or {}).get("binary_data_output"))
    out = {"name": "waveform", "datatype": "FP32", "shape": [1, int(wav.size)]}
    header = {"model_name": name, "model_version": MODEL_VERSION, "outputs": [out]}
    if "id" in doc:
        header["id"] = doc["id"]
    if not binary:
        out["data"] = wav.tolist()
        return JSONResponse(header)
    raw = wav.tobytes()
    out["parameters"] = {"binary_data_size": len(raw)}
    head = json.dumps(header).encode()
    return Response(head + raw, media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(head))})
