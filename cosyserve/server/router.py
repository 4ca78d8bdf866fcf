"""One endpoint over several serving processes: data-parallel replicas behind a router.

``cosyserve serve --workers N`` (or ``--gpus 0,1,...``: one worker per GPU, each seeing only its
own device through ``CUDA_VISIBLE_DEVICES``) starts this router in the parent process and N
ordinary ``cosyserve serve`` processes ("workers") on loopback ports. The router owns the public
ports and speaks every protocol by forwarding, so clients change nothing:

* HTTP (OpenAI ``/v1``, KServe v2 HTTP ``/v2``, voices): each request is forwarded as it is
  (method, path, query, headers incl. ``Authorization``, body) and the response streamed back
  chunk by chunk (:class:`_HttpProxy`).
* gRPC (KServe v2 / Triton ``inference.GRPCInferenceService``): a generic handler forwards the
  serialized messages of every method without decoding them (:class:`_GrpcProxy`);
  ``ModelStreamInfer`` (decoupled streaming) stays one bidirectional stream to one worker.

Speech requests go to the ready worker with the lowest load ``(in-flight + 1) / capacity``, where
in-flight counts the router's own open requests to that worker and capacity is the worker's
``cosyserve_capacity_streams`` gauge when it exports one (stall-free admission), else its
``--max-active-streams``. Other requests (voices, metadata) go round-robin to ready workers.
Voices live in the one ``--voices-dir`` every worker reads from disk per request, so a voice
added through the router is usable on every worker at once.

**Disaggregated layout** (``--llm-gpus 0 --t2w-gpus 1,2``, or ``--llm-workers N --workers M``
on a shared device): the LLM workers are ``cosyserve serve --llm-only`` processes (streaming
``POST /v1/completions``) on fixed loopback ports; the token2wav workers (role ``speech``) are
started with ``--llm-url`` pointing at them, spread round-robin over the LLM workers, and are
the only ones the router sends requests to (by load, as above). An LLM worker that dies is
restarted on the same port like any worker; the streams whose tokens it was generating end
with a clear error from their token2wav worker (``RemoteLMError``: HTTP 502 before the
response started, an in-band error after; gRPC ``UNAVAILABLE``), the others continue, and the
token2wav workers use it again once it is back. With ``serve --workers N --llm-url URL`` every
worker streams its tokens from an external LLM server instead (vLLM, SGLang, trtllm-serve).

Supervision (:class:`Worker`, one explicit state object per worker process): a worker that exits
is marked down, its in-flight requests end with a clear error (gRPC ``UNAVAILABLE`` naming the
worker; an HTTP response already streaming is cut off, as nothing else can be said after its
status line; a request not yet answered gets ``503``), the others continue untouched, and the
worker is restarted with exponential back-off (1 s doubling to 30 s, reset once it has stayed up
for a minute). ``/v2/health/ready`` is 200 while at least one worker is ready;
``GET /router/workers`` lists the workers' state; ``/metrics`` has the router's gauges and
counters plus the workers' capacity and admitted streams summed (what an autoscaler reads).
``GET/PATCH /admin/admission`` reads / changes the admission settings of every ready worker, ``POST
/admin/admission/reset`` resets their capacity models (:mod:`cosyserve.server.admin`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field

import grpc
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("cosyserve.router")

GRPC_SERVICE = "inference.GRPCInferenceService"
#: HTTP paths whose requests synthesize speech (load-balanced, counted in flight)
SPEECH_PATHS = ("/v1/audio/speech", "/v2/models/")
#: headers that describe one hop of a connection, not the message (RFC 9110 section 7.6.1)
_HOP_HEADERS = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                "transfer-encoding", "upgrade", "host", "content-length"}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class WorkerSpec:
    """How to start one worker process: its command line (without ports), extra environment
    (e.g. ``CUDA_VISIBLE_DEVICES``) and a label for logs (``"gpu 1"``, ``"cpu"``).

    ``role``: ``"speech"`` (a worker the router sends requests to: all-in-one, or token2wav with
    ``--llm-url``) or ``"llm"`` (a ``--llm-only`` worker of the disaggregated layout: only the
    token2wav workers talk to it, on its fixed loopback ``port``, which it keeps across restarts).
    """

    index: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    label: str = "cpu"
    capacity: float = 16.0  # --max-active-streams, used until the worker reports its own capacity
    role: str = "speech"
    port: int | None = None  # fixed HTTP port (LLM workers: the token2wav workers' --llm-url); None: a free one


@dataclass
class RouterConfig:
    """The router's public address, its workers and its limits.

    ``max_upload_bytes`` bounds a forwarded HTTP body (the workers enforce the same limit);
    ``ready_timeout_s``: a worker that is not ready this long after its start is restarted;
    ``metrics_port``: a second listener serving only ``GET /metrics`` (``--metrics-port``).
    """

    host: str
    port: int
    grpc_port: int
    workers: list[WorkerSpec]
    max_upload_bytes: int = 20 * 1024 * 1024
    ready_timeout_s: float = 900.0
    drain_seconds: float = 5.0
    metrics_port: int | None = None


class WorkerUnavailable(Exception):
    """No worker can take the request (all are starting, restarting or gone)."""


class Worker:
    """Runtime state of one worker process (the router's only per-worker state).

    ``state``: ``"starting"`` (process up, not ready yet), ``"ready"``, ``"down"`` (exited;
    restart pending) or ``"stopped"`` (router shutting down). ``inflight``: open requests the
    router forwarded to it. ``generation`` increases with every start, so a request can tell
    whether the process that took it is still the one running.
    """

    def __init__(self, spec: WorkerSpec, host: str = "127.0.0.1"):
        self.spec = spec
        self.host = host
        self.http_port = 0
        self.grpc_port = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.state = "down"
        self.inflight = 0
        self.capacity = float(spec.capacity)
        self.admitted = 0.0
        #: CUDA graph buckets the worker reports pending / captured (None until it has reported)
        self.graphs_pending: float | None = None
        self.graphs_captured = 0.0
        self.restarts = 0
        self.generation = 0
        self.started_at = 0.0
        self.last_exit: int | None = None
        self.http: httpx.AsyncClient | None = None
        self.channel: grpc.aio.Channel | None = None

    @property
    def name(self) -> str:
        return f"worker {self.spec.index} ({self.spec.label}, pid {self.proc.pid if self.proc else '-'})"

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def load(self) -> float:
        """Load if one more stream were sent here: (in-flight + 1) / capacity."""
        return (self.inflight + 1) / max(self.capacity, 1e-9)

    def info(self) -> dict:
        return {"index": self.spec.index, "label": self.spec.label, "role": self.spec.role, "state": self.state,
                "pid": self.proc.pid if self.proc else None, "http_port": self.http_port,
                "grpc_port": self.grpc_port, "inflight": self.inflight, "capacity": self.capacity,
                "admitted": self.admitted, "restarts": self.restarts, "last_exit": self.last_exit}


class Router:
    """Starts, watches and restarts the workers; picks a worker per request."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.workers = [Worker(s) for s in config.workers]
        #: the workers requests are sent to (the LLM workers of the disaggregated layout serve only them)
        self.speech_workers = [w for w in self.workers if w.spec.role == "speech"]
        self._rr = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self.registry = CollectorRegistry()
        self._m_state = Gauge("cosyserve_router_worker_ready", "1 if the worker is ready, else 0", ["worker"],
                              registry=self.registry)
        self._m_inflight = Gauge("cosyserve_router_inflight_requests", "requests forwarded and not finished",
                                 ["worker"], registry=self.registry)
        self._m_restarts = Counter("cosyserve_router_worker_restarts", "times a worker exited and was restarted",
                                   ["worker"], registry=self.registry)
        self._m_lost = Counter("cosyserve_router_lost_requests", "requests cut off because their worker exited",
                               ["worker"], registry=self.registry)
        self._m_capacity = Gauge("cosyserve_capacity_streams", "real-time stream capacity, summed over ready workers",
                                 registry=self.registry)
        self._m_admitted = Gauge("cosyserve_admitted_streams", "streams admitted, summed over workers",
                                 registry=self.registry)
        self._m_load = Gauge("cosyserve_load_ratio", "admitted / capacity over ready workers",
                             registry=self.registry)
        self._m_graphs_pending = Gauge(
            "cosyserve_graphs_pending", "CUDA graph buckets not captured yet, summed over the workers (LLM workers "
            "too); a worker that is not ready or has not reported counts 1: 0 once every worker is fully warmed",
            registry=self.registry)
        self._m_graphs_captured = Gauge("cosyserve_graphs_captured", "CUDA graph buckets captured, summed over "
                                        "the ready workers", registry=self.registry)
        for w in self.workers:
            for m in (self._m_state, self._m_inflight, self._m_restarts, self._m_lost):
                m.labels(str(w.spec.index))

    # ------------------------------------------------------------------ selection
    @property
    def ready(self) -> bool:
        return any(w.ready for w in self.speech_workers)

    def pick(self, speech: bool) -> Worker:
        """The worker for the next request: least loaded among ready ones for speech, round-robin
        otherwise. Raises :class:`WorkerUnavailable` when none is ready."""
        ready = [w for w in self.speech_workers if w.ready]
        if not ready:
            states = ", ".join(f"{w.spec.index}: {w.state}" for w in self.speech_workers)
            raise WorkerUnavailable(f"no worker is ready ({states}); retry shortly")
        if speech:
            return min(ready, key=lambda w: (w.load(), w.spec.index))
        return ready[next(self._rr) % len(ready)]

    def begin(self, w: Worker) -> int:
        """Count a request against ``w``; returns the worker generation it was sent to."""
        w.inflight += 1
        self._m_inflight.labels(str(w.spec.index)).set(w.inflight)
        return w.generation

    def end(self, w: Worker, generation: int, lost: bool = False) -> None:
        if w.generation == generation:
            w.inflight = max(0, w.inflight - 1)
            self._m_inflight.labels(str(w.spec.index)).set(w.inflight)
        if lost:
            self._m_lost.labels(str(w.spec.index)).inc()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start every worker's supervisor and the metrics poller (returns at once)."""
        for w in self.workers:
            self._tasks.append(asyncio.create_task(self._supervise(w), name=f"worker-{w.spec.index}"))
        self._tasks.append(asyncio.create_task(self._poll_metrics(), name="router-metrics"))

    async def stop(self) -> None:
        """SIGTERM every worker (they drain their streams), SIGKILL what is left after the drain."""
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        procs = [w.proc for w in self.workers if w.proc is not None and w.proc.returncode is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.drain_seconds + 10
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                p.kill()
                await p.wait()
        for w in self.workers:
            w.state = "stopped"
            await self._close_clients(w)

    async def _close_clients(self, w: Worker) -> None:
        """Close the worker's HTTP client and gRPC channel. Both are detached from ``w`` before they
        close, so a proxied call the close cancels can tell (its worker's channel is no longer the
        one it used) that its worker went away, not its own client."""
        http, w.http = w.http, None
        channel, w.channel = w.channel, None
        if http is not None:
            await http.aclose()
        if channel is not None:
            await channel.close()

    async def _spawn(self, w: Worker) -> None:
        w.http_port, w.grpc_port = w.spec.port or free_port(), free_port()
        argv = [sys.executable, "-m", "cosyserve.cli", "serve", *w.spec.argv, "--host", w.host,
                "--port", str(w.http_port), "--grpc-port", str(w.grpc_port)]
        env = dict(os.environ, COSYSERVE_WORKER_INDEX=str(w.spec.index), **w.spec.env)
        w.proc = await asyncio.create_subprocess_exec(*argv, env=env, stdin=asyncio.subprocess.DEVNULL)
        w.generation += 1
        w.started_at = time.monotonic()
        w.state = "starting"
        w.http = httpx.AsyncClient(base_url=f"http://{w.host}:{w.http_port}", timeout=None)
        w.channel = grpc.aio.insecure_channel(
            f"{w.host}:{w.grpc_port}",
            options=[("grpc.max_receive_message_length", 256 * 1024 * 1024),
                     ("grpc.max_send_message_length", self.config.max_upload_bytes + 1024 * 1024)])
        log.info("started %s on http %d / grpc %d", w.name, w.http_port, w.grpc_port)

    async def _wait_ready(self, w: Worker) -> bool:
        """Poll the worker's readiness until ready (True) or its process exits / times out (False)."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        while w.proc is not None and w.proc.returncode is None and time.monotonic() < deadline:
            try:
                r = await w.http.get("/v2/health/ready", timeout=2.0)
                if r.status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            try:
                await asyncio.wait_for(asyncio.shield(w.proc.wait()), 0.5)
            except asyncio.TimeoutError:
                pass
        return False

    async def _supervise(self, w: Worker) -> None:
        backoff = 0.5
        while not self._stopping:
            await self._spawn(w)
            if await self._wait_ready(w):
                w.state = "ready"
                self._m_state.labels(str(w.spec.index)).set(1)
                log.info("%s is ready (%.1f s after start)", w.name, time.monotonic() - w.started_at)
                await w.proc.wait()
            elif w.proc.returncode is None:
                log.error("%s was not ready after %.0f s; restarting it", w.name, self.config.ready_timeout_s)
                w.proc.kill()
                await w.proc.wait()
            if self._stopping:
                return
            up_for = time.monotonic() - w.started_at
            w.last_exit = w.proc.returncode
            w.state = "down"
            w.graphs_pending = None  # its graphs are gone with it: unknown until the new process reports
            w.admitted = 0.0
            self._m_state.labels(str(w.spec.index)).set(0)
            lost = w.inflight
            w.inflight = 0
            self._m_inflight.labels(str(w.spec.index)).set(0)
            await self._close_clients(w)
            w.restarts += 1
            self._m_restarts.labels(str(w.spec.index)).inc()
            backoff = 1.0 if up_for > 60 else min(backoff * 2, 30.0)
            log.error("%s exited with status %s after %.1f s (%d request(s) in flight lost); restarting in %.0f s",
                      w.name, w.last_exit, up_for, lost, backoff)
            await asyncio.sleep(backoff)

    async def _poll_metrics(self, period_s: float = 2.0) -> None:
        """Read each ready worker's capacity / admitted-streams gauges (speech workers) and CUDA-graph
        counts (every worker) when it exports them."""
        names = ("cosyserve_capacity_streams", "cosyserve_admitted_streams", "cosyserve_graphs_pending",
                 "cosyserve_graphs_captured")
        while True:
            for w in self.workers:
                if not w.ready or w.http is None:
                    continue
                try:
                    r = await w.http.get("/metrics", timeout=2.0)
                    values = _gauges(r.text, names)
                except (httpx.HTTPError, ValueError):
                    continue
                w.graphs_pending = values.get("cosyserve_graphs_pending", 0.0)
                w.graphs_captured = values.get("cosyserve_graphs_captured", 0.0)
                if w.spec.role != "speech":
                    continue
                if values.get("cosyserve_capacity_streams", 0) > 0:
                    w.capacity = values["cosyserve_capacity_streams"]
                w.admitted = values.get("cosyserve_admitted_streams", float(w.inflight))
            self.refresh_gauges()
            await asyncio.sleep(period_s)

    def refresh_gauges(self) -> None:
        ready = [w for w in self.speech_workers if w.ready]
        cap = sum(w.capacity for w in ready)
        adm = sum(max(w.admitted, w.inflight) for w in ready)
        self._m_capacity.set(cap)
        self._m_admitted.set(adm)
        self._m_load.set(adm / cap if cap > 0 else 0.0)
        self._m_graphs_pending.set(sum(w.graphs_pending if w.ready and w.graphs_pending is not None else 1.0
                                       for w in self.workers))
        self._m_graphs_captured.set(sum(w.graphs_captured for w in self.workers if w.ready))

    def render_metrics(self) -> bytes:
        self.refresh_gauges()
        return generate_latest(self.registry)


async def died(w: Worker, generation: int, grace_s: float = 1.0) -> bool:
    """True if the process of ``generation`` has exited (waiting up to ``grace_s`` for the exit to be
    noticed: a broken connection is usually seen before the child's exit status)."""
    if w.generation != generation or w.proc is None:
        return True
    if w.proc.returncode is None:
        try:
            await asyncio.wait_for(asyncio.shield(w.proc.wait()), grace_s)
        except asyncio.TimeoutError:
            return False
    return True


def _gauges(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of the samples of the named metrics in a Prometheus text page."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in names:
            out[fam.name] = sum(s.value for s in fam.samples if s.name == fam.name)
    return out


# ---------------------------------------------------------------------- HTTP


def _forward_headers(request: Request) -> list[tuple[str, str]]:
    """The request's headers a worker gets (``Authorization`` included), less the hop-by-hop ones."""
    return [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS]


def _error(path: str, status: int, message: str) -> JSONResponse:
    if path.startswith("/v1"):
        return JSONResponse({"error": {"message": message, "type": "server_error" if status >= 500 else
                                       "invalid_request_error", "param": None, "code": "worker_unavailable"}},
                            status_code=status)
    return JSONResponse({"error": message}, status_code=status)


class _HttpProxy:
    """Forwards one HTTP request to a worker and streams the answer back."""

    def __init__(self, router: Router):
        self.router = router

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        cfg = self.router.config
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > cfg.max_upload_bytes:
            return _error(path, 413, f"request body is larger than {cfg.max_upload_bytes} bytes")
        body = await request.body()
        if len(body) > cfg.max_upload_bytes:
            return _error(path, 413, f"request body is larger than {cfg.max_upload_bytes} bytes")
        speech = request.method == "POST" and path.startswith(SPEECH_PATHS)
        headers = _forward_headers(request)
        tried: set[int] = set()
        while True:
            try:
                w = self.router.pick(speech)
            except WorkerUnavailable as exc:
                return _error(path, 503, str(exc))
            if w.spec.index in tried:
                return _error(path, 503, f"{w.name} did not accept the request; retry shortly")
            tried.add(w.spec.index)
            gen = self.router.begin(w)
            try:
                upstream = await w.http.send(
                    w.http.build_request(request.method, path, params=request.url.query, headers=headers,
                                         content=body), stream=True)
            except httpx.ConnectError:  # never reached the worker: safe to send elsewhere
                self.router.end(w, gen)
                continue
            except httpx.HTTPError as exc:
                self.router.end(w, gen, lost=True)
                return _error(path, 503, f"{w.name} failed before answering ({type(exc).__name__}); retry")
            break
        return StreamingResponse(self._relay(w, gen, upstream), status_code=upstream.status_code,
                                 headers={k: v for k, v in upstream.headers.items() if k.lower() not in
                                          _HOP_HEADERS - {"content-length"}})

    async def _relay(self, w: Worker, gen: int, upstream: httpx.Response):
        lost = False
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            lost = True
            await died(w, gen)
            log.error("%s stopped while streaming a response (%s); the client's response is cut off", w.name,
                      type(exc).__name__)
            raise
        finally:
            await upstream.aclose()
            self.router.end(w, gen, lost=lost)


def create_router_app(router: Router) -> FastAPI:
    """The router's HTTP application: its own health, metrics and worker list, everything else forwarded."""
    app = FastAPI(title="cosyserve router", docs_url=None, redoc_url=None, openapi_url=None)
    proxy = _HttpProxy(router)

    @app.get("/v2/health/live")
    async def live():
        return Response(status_code=200)

    @app.get("/v2/health/ready")
    async def ready():
        return Response(status_code=200 if router.ready else 503)

    @app.get("/health")
    async def health():
        return {"status": "ready" if router.ready else "loading", "workers": [w.info() for w in router.workers]}

    @app.get("/router/workers")
    async def workers():
        return {"workers": [w.info() for w in router.workers]}

    @app.get("/metrics")
    async def metrics():
        return Response(router.render_metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/admin/admission", methods=["GET", "PATCH"])
    @app.api_route("/admin/admission/reset", methods=["POST"])
    async def admission(request: Request):
        """Every ready worker's admission settings (:mod:`cosyserve.server.admin`): a change (or a reset) goes to
        all of them (each engine admits its own streams); a worker restarted later starts with its command line's
        settings. One worker's 4xx (a bad setting: every worker rejects it the same way, changing nothing) is the
        answer."""
        body = await request.body()
        headers = _forward_headers(request)
        out = []
        for w in router.workers:
            if not w.ready:
                out.append({**w.info(), "status": None})
                continue
            try:
                r = await w.http.request(request.method, request.url.path, headers=headers, content=body)
            except httpx.HTTPError as exc:
                out.append({**w.info(), "status": None, "error": f"{type(exc).__name__}: {exc}"})
                continue
            if 400 <= r.status_code < 500:
                return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
            out.append({**w.info(), "status": r.status_code, **(r.json() if r.status_code == 200 else
                                                                 {"error": r.text})})
        if not any(x["status"] == 200 for x in out):
            return _error(request.url.path, 503, "no worker is ready to answer; retry shortly")
        return {"workers": out}

    app.add_api_route("/{path:path}", proxy, methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                      include_in_schema=False)
    return app


# ---------------------------------------------------------------------- gRPC


def _service_methods() -> dict[str, bool]:
    """Method name -> client-and-server streaming, from the KServe v2 protos shipped by tritonclient."""
    from tritonclient.grpc import service_pb2 as pb

    svc = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    return {m.name: bool(m.client_streaming or m.server_streaming) for m in svc.methods}


#: methods answered by the router itself (about the router, not one worker)
_LOCAL = ("ServerLive", "ServerReady")
#: methods that synthesize speech (least-loaded worker)
_SPEECH = ("ModelInfer", "ModelStreamInfer")


class _GrpcProxy(grpc.GenericRpcHandler):
    """Forwards every KServe v2 gRPC method as raw bytes (no decoding) to a worker."""

    def __init__(self, router: Router):
        self.router = router
        self.methods = _service_methods()

    def service(self, handler_call_details):
        prefix = f"/{GRPC_SERVICE}/"
        method = handler_call_details.method
        if not method.startswith(prefix):
            return None
        name = method[len(prefix):]
        if name not in self.methods:
            return None
        if name in _LOCAL:
            return grpc.unary_unary_rpc_method_handler(self._local(name))
        if self.methods[name]:
            return grpc.stream_stream_rpc_method_handler(self._stream(method))
        return grpc.unary_unary_rpc_method_handler(self._unary(method, name in _SPEECH))

    def _local(self, name: str):
        from tritonclient.grpc import service_pb2 as pb

        async def handler(request: bytes, context) -> bytes:
            if name == "ServerLive":
                return pb.ServerLiveResponse(live=True).SerializeToString()
            return pb.ServerReadyResponse(ready=self.router.ready).SerializeToString()
        return handler

    @staticmethod
    def _metadata(context) -> list[tuple[str, str]]:
        return [(k, v) for k, v in (context.invocation_metadata() or ()) if not k.startswith((":", "grpc-"))
                and k not in ("user-agent", "te", "content-type")]

    def _pick(self, speech: bool) -> Worker:
        return self.router.pick(speech)

    @staticmethod
    async def _fail(w: Worker, gen: int, channel, exc: BaseException) -> bool:
        """After the worker's call ended with ``exc``: re-raises ``exc`` when it is this RPC's own
        cancellation (client gone, server stopping); otherwise returns whether the request was lost
        (its worker's process exited), for the caller's bookkeeping, after which the caller ends the
        client's call with :meth:`_abort`. A call cancelled under the RPC raises CancelledError, not an
        RPC error: the supervisor closed the exited worker's channel before the transport noticed the
        broken connection (the channel is no longer ``w.channel``). One check of the exit serves the
        bookkeeping and the client's status; a worker that answered with a status of its own (not
        ``UNAVAILABLE``, e.g. ``INVALID_ARGUMENT`` for bad input) is alive, and its status is relayed
        without waiting for an exit — except ``CANCELLED`` from a channel the supervisor has closed meanwhile
        (grpc's "Locally cancelled by application!": the channel's close cancelled the call, seen once on a
        loaded 2-core machine where the killed worker's client then got that status instead of
        ``UNAVAILABLE`` naming the worker), which is checked for an exit like ``UNAVAILABLE``."""
        if isinstance(exc, asyncio.CancelledError) and w.channel is channel:
            raise exc
        if isinstance(exc, grpc.aio.AioRpcError) and exc.code() != grpc.StatusCode.UNAVAILABLE \
                and not (exc.code() == grpc.StatusCode.CANCELLED and w.channel is not channel):
            return False
        return await died(w, gen, grace_s=2.0)

    @staticmethod
    async def _abort(context, w: Worker, lost: bool, exc: BaseException) -> None:
        """End the client's call: ``UNAVAILABLE`` naming the worker when the request was lost, else the
        worker's own status (``UNAVAILABLE`` for a call cancelled under the RPC)."""
        if lost:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"{w.name} stopped while serving this request; it was lost — retry "
                                f"(other requests are unaffected)")
        if isinstance(exc, grpc.aio.AioRpcError):
            await context.abort(exc.code(), exc.details() or "")
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"{w.name} went away")

    def _unary(self, method: str, speech: bool):
        async def handler(request: bytes, context) -> bytes:
            try:
                w = self._pick(speech)
            except WorkerUnavailable as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            gen = self.router.begin(w)
            channel = w.channel
            lost = False
            try:
                return await channel.unary_unary(method)(request, metadata=self._metadata(context))
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
                lost = await self._fail(w, gen, channel, exc)
                await self._abort(context, w, lost, exc)
            finally:
                self.router.end(w, gen, lost=lost)
        return handler

    def _stream(self, method: str):
        async def handler(request_iterator, context):
            try:
                w = self._pick(True)
            except WorkerUnavailable as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            gen = self.router.begin(w)
            channel = w.channel
            call = channel.stream_stream(method)(request_iterator, metadata=self._metadata(context))
            lost = False
            try:
                async for response in call:
                    yield response
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
                lost = await self._fail(w, gen, channel, exc)
                await self._abort(context, w, lost, exc)
            finally:
                call.cancel()
                self.router.end(w, gen, lost=lost)
        return handler


async def start_router_grpc(router: Router) -> grpc.aio.Server:
    """Listen on the router's gRPC port (raises ``RuntimeError`` if it cannot be bound)."""
    cfg = router.config
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", cfg.max_upload_bytes),
                                      ("grpc.max_send_message_length", 256 * 1024 * 1024)])
    server.add_generic_rpc_handlers((_GrpcProxy(router),))
    addr = f"{cfg.host}:{cfg.grpc_port}"
    if server.add_insecure_port(addr) == 0:
        raise RuntimeError(f"cannot listen on {addr} (gRPC)")
    await server.start()
    return server


async def serve_router(config: RouterConfig) -> None:
    """Run the router (HTTP + gRPC) and its workers until SIGINT/SIGTERM, then stop the workers
    (each drains its streams) and the servers."""
    import uvicorn

    from .app import _UvicornServer

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per forwarded request otherwise
    router = Router(config)
    app = create_router_app(router)
    uv = _UvicornServer(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                       access_log=False, lifespan="off", timeout_graceful_shutdown=2))
    grpc_server = await start_router_grpc(router)
    metrics_srv = None
    if config.metrics_port:
        from .app import serve_metrics

        metrics_srv = await serve_metrics(router.render_metrics, "text/plain; version=0.0.4; charset=utf-8",
                                          config.host, config.metrics_port)
    await router.start()
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task] = []

    async def _shutdown() -> None:
        log.info("router shutting down: stopping %d worker(s)", len(router.workers))
        await router.stop()
        await grpc_server.stop(grace=2)
        uv.should_exit = True

    def _on_signal() -> None:
        if not stopping:
            stopping.append(asyncio.create_task(_shutdown()))
        else:
            uv.force_exit = True
            uv.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _on_signal)
    log.info("router listening on http://%s:%d and %s:%d (gRPC) over %d worker(s)", config.host, config.port,
             config.host, config.grpc_port, len(router.workers))
    try:
        await uv.serve()
    finally:
        if stopping:
            await stopping[0]
        else:
            await router.stop()
            await grpc_server.stop(grace=0)
        from .app import stop_metrics

        await stop_metrics(metrics_srv)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
