"""The serving process: one FastAPI app (OpenAI + KServe HTTP + metrics) and one gRPC server.

``cosyserve serve`` runs both in one asyncio loop with one :class:`ServerState`: the HTTP
port answers at once (live), models load in a worker thread, and readiness flips after a
warm-up request. SIGINT/SIGTERM stop accepting requests, let running streams finish for
a few seconds, then cancel what is left.

With ``--llm-only`` the process serves the speech LM alone (``POST /v1/completions``,
:mod:`cosyserve.server.completions`): the speech routes answer 404 and no gRPC port is
opened.

With ``--llm-url`` the speech LM's tokens come from that completions server
(:mod:`cosyserve.engine.token_source`); its failures answer 502 (``llm_server_error``).
``--metrics-port`` adds a listener that serves only ``GET /metrics``, without the API key.

Cross-cutting rules implemented here: optional API key (``Authorization: Bearer``) on
every route except health; request bodies larger than ``--max-upload-mb`` are refused
(413: from ``Content-Length`` before reading, or once a chunked body passes the limit);
errors become 4xx/5xx with a message naming the field — OpenAI's error shape on ``/v1``,
``{"error": ...}`` on ``/v2``, also for FastAPI's own errors (unparseable bodies, unknown
routes) — and never affect other requests. The contract is tested request by request by
``tests/test_reliability.py`` (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.base import BaseHTTPMiddleware

from ..client.remote_lm import RemoteLMError
from ..engine.core import QueueFullError
from ..errors import CosyServeError, InvalidInputError, VoiceNotFoundError
from . import admin, completions, kserve_http, openai_api
from .state import ClientDisconnectedError, NotReadyError, ServerConfig, ServerState

log = logging.getLogger("cosyserve.server")

PUBLIC_PATHS = ("/v2/health/", "/health")
#: routes that synthesize audio; a ``--llm-only`` server answers them with 404
TTS_PATHS = ("/v1/audio/", "/v2/models/")


def _error(request: Request, status: int, message: str, field: str | None = None, code: str | None = None):
    if request.url.path.startswith("/v1"):
        return openai_api.openai_error(status, message, field, code)
    return JSONResponse({"error": message}, status_code=status)


class _Guard(BaseHTTPMiddleware):
    """API key and upload-size checks before a request reaches a route."""

    async def dispatch(self, request: Request, call_next):
        st: ServerState = request.app.state.cosyserve
        key = st.config.api_key
        if key and not request.url.path.startswith(PUBLIC_PATHS):
            auth = request.headers.get("authorization", "")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), key.encode()):
                return _error(request, 401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                              code="invalid_api_key")
        if st.config.llm_only and request.url.path.startswith(TTS_PATHS):
            return _error(request, 404, "this server runs with --llm-only: it serves the speech LM on "
                                        "POST /v1/completions, not speech", code="not_found")
        length = request.headers.get("content-length")
        if length is not None:
            try:
                too_big = int(length) > st.config.max_upload_bytes
            except ValueError:
                return _error(request, 400, "invalid Content-Length header")
            if too_big:
                return _error(request, 413, f"request body is larger than {st.config.max_upload_bytes} bytes "
                                            f"(--max-upload-mb)", "body", code="too_large")
        return await call_next(request)


class _ChunkedBodyLimit:
    """ASGI middleware: a request body sent without ``Content-Length`` (chunked transfer
    encoding) is read here first, and refused with 413 once it exceeds ``--max-upload-mb``
    (bodies with a ``Content-Length`` are checked from the header by :class:`_Guard`). The
    route then reads the buffered body as usual, so no route ever holds more than the limit."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or any(k == b"content-length" for k, _ in scope.get("headers", ())):
            return await self.app(scope, receive, send)
        st: ServerState = scope["app"].state.cosyserve if "app" in scope else None
        limit = st.config.max_upload_bytes if st is not None else None
        messages, size = [], 0
        while True:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                break
            size += len(msg.get("body", b""))
            if limit is not None and size > limit:
                resp = _error(Request(scope), 413, f"request body is larger than {limit} bytes (--max-upload-mb)",
                              "body", code="too_large")
                return await resp(scope, receive, send)
            if not msg.get("more_body", False):
                break

        async def replay():
            if messages:
                return messages.pop(0)
            return await receive()

        return await self.app(scope, replay, send)


def create_app(state: ServerState) -> FastAPI:
    """The HTTP application around ``state`` (models are loaded by :meth:`ServerState.start`)."""
    app = FastAPI(title="cosyserve", description="CosyVoice2 TTS: OpenAI speech API, voices, KServe v2",
                  docs_url="/docs", openapi_url="/openapi.json")
    app.state.cosyserve = state
    app.add_middleware(_Guard)
    app.add_middleware(_ChunkedBodyLimit)  # outermost: runs before _Guard
    app.include_router(openai_api.router)
    app.include_router(kserve_http.router)
    app.include_router(completions.router)
    app.include_router(admin.router)

    @app.get("/health")
    async def health():
        return {"status": "ready" if state.ready else ("failed" if state.load_error else "loading")}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.exception_handler(VoiceNotFoundError)
    async def _unknown_voice(request: Request, exc: VoiceNotFoundError):
        return _error(request, 400 if request.method == "POST" else 404, str(exc), exc.field, "voice_not_found")

    @app.exception_handler(InvalidInputError)
    async def _invalid(request: Request, exc: InvalidInputError):
        return _error(request, 400, str(exc), exc.field, "invalid_input")

    @app.exception_handler(QueueFullError)
    async def _busy(request: Request, exc: QueueFullError):
        r = _error(request, 429, str(exc), None, "rate_limit_exceeded")
        r.headers["Retry-After"] = "1"
        return r

    @app.exception_handler(NotReadyError)
    async def _not_ready(request: Request, exc: NotReadyError):
        return _error(request, 503, str(exc), None, "not_ready")

    @app.exception_handler(TimeoutError)
    async def _timeout(request: Request, exc: TimeoutError):
        return _error(request, 504, str(exc) or "request timed out", None, "timeout")

    @app.exception_handler(ClientDisconnectedError)
    async def _gone(request: Request, exc: ClientDisconnectedError):
        return Response(status_code=499)  # nobody is listening any more

    @app.exception_handler(RemoteLMError)
    async def _remote_lm(request: Request, exc: RemoteLMError):
        return _error(request, 502, str(exc), None, "llm_server_error")  # the LM server (--llm-url) failed

    @app.exception_handler(CosyServeError)
    async def _other(request: Request, exc: CosyServeError):
        return _error(request, 400, str(exc), getattr(exc, "field", None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        """Starlette/FastAPI's own errors (unknown route, wrong method, a body that cannot be
        parsed at all) in the protocol's error shape."""
        if exc.status_code == 400:  # FastAPI: "There was an error parsing the body"
            cause = exc.__cause__ or exc.__context__
            detail = str(exc.detail)
            if cause is not None and str(cause) and str(cause) not in detail:
                detail = f"{detail}: {cause}"
            if isinstance(cause, RecursionError):
                detail = "the request body is nested too deeply"
            return _error(request, 400, f"malformed request body ({detail})", "body", "invalid_body")
        if exc.status_code == 404:
            return _error(request, 404, f"no route {request.method} {request.url.path}", None, "not_found")
        if exc.status_code == 405:
            return _error(request, 405, f"method {request.method} is not allowed on {request.url.path}", None,
                          "method_not_allowed")
        return _error(request, exc.status_code, str(exc.detail), None)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        # the top-level request field (pydantic adds union members / nested keys after it)
        loc = [str(x) for x in first.get("loc", ()) if x not in ("body", "query", "path", "header")]
        field = loc[0] if loc else ("body" if tuple(first.get("loc", ()))[:1] == ("body",) else None)
        if first.get("type") == "json_invalid":
            return _error(request, 400, "malformed JSON in the request body", "body", "invalid_json")
        what = first.get("msg", "invalid value")
        if field == "body":
            msg = f"invalid request body: {what} (expected a JSON object)" if first.get("type") in (
                "model_attributes_type", "dict_type") else f"invalid request body: {what}"
        elif field:
            msg = f"invalid field '{field}': {what}"
        else:
            msg = f"invalid request: {what}"
        return _error(request, 400, msg, field, "invalid_request")

    return app


def create_metrics_app(render, content_type: str) -> FastAPI:
    """A plain HTTP app serving only ``GET /metrics`` (``render()`` -> bytes), without the API
    key (``--metrics-port``): Prometheus scrapers usually hold no key, and this listener opens
    nothing else (every other path is 404)."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/metrics")
    async def metrics():
        return Response(render(), media_type=content_type)

    return app


async def serve_metrics(render, content_type: str, host: str, port: int):
    """Start the ``--metrics-port`` listener; returns its uvicorn server (``should_exit = True``
    stops it) and its task. Raises OSError when the port cannot be bound."""
    import socket

    import uvicorn

    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as exc:
        raise OSError(f"cannot listen on {host}:{port} (--metrics-port): {exc.strerror or exc}") from None
    uv = _UvicornServer(uvicorn.Config(create_metrics_app(render, content_type), host=host, port=port,
                                       log_level="warning", access_log=False, lifespan="off"))
    if not uv.config.loaded:
        uv.config.load()
    uv.lifespan = uv.config.lifespan_class(uv.config)
    await uv.startup(sockets=[sock])
    task = asyncio.create_task(uv.main_loop())
    return uv, task


async def stop_metrics(handle) -> None:
    if handle is None:
        return
    uv, task = handle
    uv.should_exit = True
    await task
    await uv.shutdown()


class _UvicornServer:
    """uvicorn without its own signal handling (cosyserve drains streams first, then stops it)."""

    def __new__(cls, config):
        import contextlib

        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        return Server(config)


#: exit status of a server whose device context was lost (a sticky CUDA error): restart it
EXIT_DEVICE_LOST = 75


async def serve(config: ServerConfig, log_format: str = "text", drain_seconds: float = 5.0) -> None:
    """Run the HTTP and gRPC servers until SIGINT/SIGTERM.

    Shutdown: readiness drops, running streams get ``drain_seconds`` to finish, the rest are
    ended cleanly (their responses terminate normally), then both servers stop. A lost device
    context (a sticky CUDA error such as an illegal memory access, after which every request of
    this process would fail) stops the servers at once and raises ``SystemExit(EXIT_DEVICE_LOST)``,
    so that a supervisor (``serve --workers``' router, systemd, Kubernetes) starts a fresh process.
    """
    import signal

    import uvicorn

    from .kserve_grpc import start_grpc_server

    state = ServerState(config)
    app = create_app(state)
    uv = _UvicornServer(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                       access_log=False, lifespan="off", timeout_graceful_shutdown=2))
    grpc_server = None if config.llm_only else await start_grpc_server(state, config.host, config.grpc_port)
    metrics_srv = None
    if config.metrics_port:
        metrics_srv = await serve_metrics(state.metrics.render, state.metrics.content_type, config.host,
                                          config.metrics_port)
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task] = []
    exit_status: list[int] = []

    async def _shutdown(drain_s: float = drain_seconds) -> None:
        log.info("shutting down", extra={"event": "shutdown", "drain_s": drain_s})
        await state.stop(drain_timeout=drain_s)  # not ready; drain; abort the rest cleanly
        if grpc_server is not None:
            await grpc_server.stop(grace=2)
        uv.should_exit = True

    def _on_signal() -> None:
        if not stopping:
            stopping.append(asyncio.create_task(_shutdown()))
        else:  # a second signal: stop now
            uv.force_exit = True
            uv.should_exit = True

    def _on_device_lost(exc: BaseException) -> None:  # nothing on this device can run again: exit, be restarted
        if not stopping:
            exit_status.append(EXIT_DEVICE_LOST)
            stopping.append(asyncio.create_task(_shutdown(0.0)))

    state.on_device_lost = _on_device_lost
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _on_signal)
    loader = asyncio.create_task(state.start())
    log.info("listening", extra={"event": "listening", "http": f"http://{config.host}:{config.port}",
                                 "grpc": None if grpc_server is None else f"{config.host}:{config.grpc_port}",
                                 "llm_only": config.llm_only})

    def _loaded(t: asyncio.Task) -> None:
        if not t.cancelled() and t.exception() is not None:
            log.error("the server stays up but not ready: %s", t.exception())

    loader.add_done_callback(_loaded)
    try:
        await uv.serve()
    finally:
        loader.cancel()
        if stopping:
            await stopping[0]
        else:
            if grpc_server is not None:
                await grpc_server.stop(grace=0)
            await state.stop(drain_timeout=0)
        await stop_metrics(metrics_srv)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if exit_status:
        log.critical("exiting with status %d: the device context was lost", exit_status[0])
        raise SystemExit(exit_status[0])
