"""KServe v2 / Triton gRPC protocol (``inference.GRPCInferenceService``).

Uses the generated stubs shipped by ``tritonclient`` (no hand-written protobuf). RPCs:
ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelConfig,
ModelStatistics, ModelInfer (offline: the whole waveform) and ModelStreamInfer
(decoupled streaming, as Triton's decoupled models): one response per audio chunk, each
carrying the ``triton_final_response`` parameter (false), then — when the request set
``triton_enable_empty_final_response`` as ``tritonclient``'s ``async_stream_infer(...,
enable_empty_final_response=True)`` does — an empty response with
``triton_final_response = true``. Several requests may share one stream; their responses
interleave and are told apart by ``id``. The model interface is in
:mod:`cosyserve.server.kserve_common`.

Errors: unary RPCs abort with INVALID_ARGUMENT (bad input), NOT_FOUND (unknown model or
voice), RESOURCE_EXHAUSTED (queue full), UNAVAILABLE (loading), UNAUTHENTICATED (API
key), INVALID_ARGUMENT naming ``request`` for a message protobuf cannot parse; on a
stream, a failing request gets a response with ``error_message`` (prefixed by its status
code) and ``infer_response.id`` set to its id, and the stream stays open for the others.
Engine request ids are unique whatever ``id`` clients send (see ``ServerState.build_request``).
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging

import grpc
import numpy as np
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from .. import __version__
from ..client.remote_lm import RemoteLMError
from ..engine.core import QueueFullError
from ..errors import CosyServeError, InvalidInputError, VoiceNotFoundError
from .kserve_common import (
    INPUTS,
    MODEL_VERSION,
    NUMPY_DTYPES,
    OUTPUTS,
    _count,
    build_request,
    decode_raw,
    model_parameters,
    parse_request,
)
from .state import NotReadyError, ServerState

log = logging.getLogger("cosyserve.server")

_CONTENTS = {"FP32": "fp32_contents", "FP64": "fp64_contents", "INT32": "int_contents", "INT64": "int64_contents",
             "BYTES": "bytes_contents", "BOOL": "bool_contents", "UINT32": "uint_contents",
             "UINT64": "uint64_contents"}


class ModelNotFoundError(CosyServeError):
    """A request names a model or version this server does not serve (NOT_FOUND)."""


def _status_of(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, (VoiceNotFoundError, ModelNotFoundError)):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, InvalidInputError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, NotReadyError):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, RemoteLMError):  # the LM server of --llm-url failed
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, CosyServeError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def _param(p: pb.InferParameter):
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def decode_inputs(request: pb.ModelInferRequest) -> dict:
    """Decode the input tensors of a ModelInferRequest (raw or typed contents)."""
    tensors = {}
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InvalidInputError(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs", field="inputs")
    for i, t in enumerate(request.inputs):
        shape = [int(s) for s in t.shape]
        if raw:
            value = decode_raw(t.name, t.datatype, shape, raw[i])
        else:
            field = _CONTENTS.get(t.datatype)
            if field is None:
                raise InvalidInputError(f"input '{t.name}': unsupported datatype {t.datatype}", field=t.name)
            vals = list(getattr(t.contents, field))
            n = _count(t.name, shape) if shape else 1
            if len(vals) != n:
                raise InvalidInputError(f"input '{t.name}': {len(vals)} values for shape {shape}", field=t.name)
            value = vals if t.datatype == "BYTES" else np.asarray(vals, dtype=NUMPY_DTYPES[t.datatype]).reshape(shape)
        if t.name in tensors:
            raise InvalidInputError(f"input '{t.name}' is given twice", field=t.name)
        tensors[t.name] = (t.datatype, shape, value)
    return tensors


def _waveform_response(request: pb.ModelInferRequest, samples: np.ndarray, final: bool | None) -> pb.ModelInferResponse:
    wav = np.ascontiguousarray(samples, dtype="<f4")
    resp = pb.ModelInferResponse(model_name=request.model_name, model_version=MODEL_VERSION, id=request.id)
    out = resp.outputs.add()
    out.name, out.datatype = "waveform", "FP32"
    out.shape.extend([1, int(wav.size)])
    resp.raw_output_contents.append(wav.tobytes())
    if final is not None:
        resp.parameters["triton_final_response"].bool_param = final
    return resp


class TritonService(pb_grpc.GRPCInferenceServiceServicer):
    """``inference.GRPCInferenceService`` backed by :class:`ServerState`."""

    def __init__(self, state: ServerState):
        self.state = state

    # ---------------------------------------------------------------- helpers
    async def _auth(self, context, public: bool = False) -> None:
        key = self.state.config.api_key
        if not key or public:
            return
        md = dict(context.invocation_metadata() or ())
        auth = md.get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key (metadata "
                                                                 "'authorization: Bearer <key>')")

    async def _model(self, name: str, version: str, context) -> None:
        if name != self.state.config.model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"unknown model '{name}' (this server serves '{self.state.config.model_name}')")
        if version not in ("", MODEL_VERSION):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown version '{version}' of model '{name}'")

    async def _prepare(self, request: pb.ModelInferRequest, stream: bool):
        st = self.state
        st.require_ready()
        params = {k: _param(v) for k, v in request.parameters.items()}
        req = parse_request(decode_inputs(request), params)
        for o in request.outputs:
            if o.name != "waveform":
                raise InvalidInputError(f"'outputs' names an unknown output '{o.name}'; the only output is "
                                        f"'waveform'", field="outputs")
        return await build_request(st, req, stream, request_id=request.id or None)

    # ---------------------------------------------------------------- health & metadata
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.state.ready)

    async def ModelReady(self, request, context):
        await self._auth(context)
        ok = request.name == self.state.config.model_name and request.version in ("", MODEL_VERSION)
        return pb.ModelReadyResponse(ready=ok and self.state.ready)

    async def ServerMetadata(self, request, context):
        await self._auth(context)
        return pb.ServerMetadataResponse(name="cosyserve", version=__version__,
                                         extensions=["binary_tensor_data", "statistics", "model_configuration"])

    async def ModelMetadata(self, request, context):
        await self._auth(context)
        await self._model(request.name, request.version, context)
        resp = pb.ModelMetadataResponse(name=request.name, versions=[MODEL_VERSION], platform="cosyserve")
        for n, t, s, _ in INPUTS:
            resp.inputs.add(name=n, datatype=t, shape=s)
        for n, t, s in OUTPUTS:
            resp.outputs.add(name=n, datatype=t, shape=s)
        return resp

    async def ModelConfig(self, request, context):
        await self._auth(context)
        await self._model(request.name, request.version, context)
        dt = {"FP32": mc.TYPE_FP32, "INT32": mc.TYPE_INT32, "BYTES": mc.TYPE_STRING}
        cfg = mc.ModelConfig(name=request.name, platform="cosyserve", backend="cosyserve",
                             max_batch_size=self.state.config.engine.max_active)
        cfg.model_transaction_policy.decoupled = True
        for k, v in model_parameters(self.state.config).items():
            cfg.parameters[k].string_value = v
        for n, t, s, opt in INPUTS:
            cfg.input.add(name=n, data_type=dt[t], dims=[s[1]], optional=opt)
        for n, t, s in OUTPUTS:
            cfg.output.add(name=n, data_type=dt[t], dims=[s[1]])
        return pb.ModelConfigResponse(config=cfg)

    async def ModelStatistics(self, request, context):
        await self._auth(context)
        if request.name and request.name != self.state.config.model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model '{request.name}'")
        s = self.state.stats
        resp = pb.ModelStatisticsResponse()
        m = resp.model_stats.add(name=self.state.config.model_name, version=MODEL_VERSION,
                                 inference_count=s["inference_count"], execution_count=s["inference_count"])
        m.inference_stats.success.count = s["success"]
        m.inference_stats.success.ns = s["success_ns"]
        m.inference_stats.fail.count = s["fail"]
        return resp

    # ---------------------------------------------------------------- inference
    async def ModelInfer(self, request, context):
        await self._auth(context)
        await self._model(request.model_name, request.model_version, context)
        try:
            req = await self._prepare(request, stream=False)
            pieces = [ch.samples async for ch in self.state.stream("kserve_grpc", req)]
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            await context.abort(_status_of(exc), str(exc))
        wav = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        return _waveform_response(request, wav, None)

    async def ModelStreamInfer(self, request_iterator, context):
        await self._auth(context)
        out: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()

        async def one(request: pb.ModelInferRequest) -> None:
            empty_final = bool(_param(request.parameters["triton_enable_empty_final_response"])) \
                if "triton_enable_empty_final_response" in request.parameters else False
            try:
                if request.model_name != self.state.config.model_name:
                    raise ModelNotFoundError(f"unknown model '{request.model_name}' (this server serves "
                                             f"'{self.state.config.model_name}')")
                if request.model_version not in ("", MODEL_VERSION):
                    raise ModelNotFoundError(f"unknown version '{request.model_version}' of model "
                                             f"'{request.model_name}'")
                req = await self._prepare(request, stream=True)
                async for ch in self.state.stream("kserve_grpc", req):
                    await out.put(pb.ModelStreamInferResponse(
                        infer_response=_waveform_response(request, ch.samples, False)))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reported in-band, the stream stays open
                code = _status_of(exc)
                if code is grpc.StatusCode.INTERNAL:
                    log.exception("stream request %s failed", request.id)
                await out.put(pb.ModelStreamInferResponse(  # the id tells which request failed
                    error_message=f"{code.name}: {exc}",
                    infer_response=pb.ModelInferResponse(model_name=request.model_name, id=request.id)))
                return
            if empty_final:
                resp = pb.ModelInferResponse(model_name=request.model_name, model_version=MODEL_VERSION,
                                             id=request.id)
                resp.parameters["triton_final_response"].bool_param = True
                await out.put(pb.ModelStreamInferResponse(infer_response=resp))

        async def reader() -> None:
            async for request in request_iterator:
                t = asyncio.create_task(one(request))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
            await out.put(None)

        read_task = asyncio.create_task(reader())
        try:
            while True:
                item = await out.get()
                if item is None:
                    break
                yield item
        finally:
            read_task.cancel()
            for t in list(tasks):
                t.cancel()


class Undecodable:
    """Stands for a request message that protobuf could not parse (not protobuf at all, or a
    string field holding invalid UTF-8); the RPC answers INVALID_ARGUMENT naming ``request``."""

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(deserializer):
    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
            return Undecodable(exc)

    return parse


def _checked_unary(handler):
    async def call(request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request: not a valid protobuf message of this RPC ({request.error})")
        result = handler(request, context)
        return await result if inspect.isawaitable(result) else result

    return call


def _checked_stream(handler):
    async def call(request_iterator, context):
        async def requests():
            async for r in request_iterator:
                if isinstance(r, Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"request: not a valid protobuf message of this RPC ({r.error})")
                yield r

        async for resp in handler(requests(), context):
            yield resp

    return call


def _add_service(servicer: TritonService, server: grpc.aio.Server) -> None:
    """``add_GRPCInferenceServiceServicer_to_server`` with request parsing that cannot fail:
    grpc answers UNKNOWN (and logs a traceback) when a deserializer raises, so undecodable
    messages reach the handlers as :class:`Undecodable` and are refused with INVALID_ARGUMENT."""

    class _Capture:
        def add_generic_rpc_handlers(self, handlers):
            pass

        def add_registered_method_handlers(self, name, handlers):
            self.name, self.handlers = name, handlers

    cap = _Capture()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, cap)
    handlers = {}
    for method, h in cap.handlers.items():
        if h.unary_unary is not None:
            h = h._replace(request_deserializer=_tolerant(h.request_deserializer),
                           unary_unary=_checked_unary(h.unary_unary))
        elif h.stream_stream is not None:
            h = h._replace(request_deserializer=_tolerant(h.request_deserializer),
                           stream_stream=_checked_stream(h.stream_stream))
        handlers[method] = h
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(cap.name, handlers),))


async def start_grpc_server(state: ServerState, host: str, port: int) -> grpc.aio.Server:
    """Start the gRPC server (returns once it listens). Raises ``RuntimeError`` if the
    port cannot be bound."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", state.config.max_upload_bytes),
                                      ("grpc.max_send_message_length", 256 * 1024 * 1024)])
    _add_service(TritonService(state), server)
    addr = f"{host}:{port}"
    if server.add_insecure_port(addr) == 0:
        raise RuntimeError(f"cannot listen on {addr} (gRPC)")
    await server.start()
    return server
