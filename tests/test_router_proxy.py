"""The router's gRPC proxy when the worker under a stream goes away, without starting worker processes.

A fake worker (a gRPC server streaming responses forever) stands behind a real router gRPC server.
When a worker process exits, two things race: the channel's transport notices the broken connection
(the call fails with UNAVAILABLE), and the supervisor, seeing the exit, closes the worker's channel
(the call is cancelled: ``asyncio.CancelledError``, not an RPC error). Either way the client's stream
must end with UNAVAILABLE naming the worker; the second order once left it open with no status until
the client gave up (tests/test_router.py's killed-worker test, seen in CI). A client that cancels its
own stream must still cancel the worker's call.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from _server import free_ports
from cosyserve.server.router import GRPC_SERVICE, Router, RouterConfig, WorkerSpec, start_router_grpc

METHOD = f"/{GRPC_SERVICE}/ModelStreamInfer"
UNARY = f"/{GRPC_SERVICE}/ModelInfer"


class _FakeWorker(grpc.GenericRpcHandler):
    """Streams ``b"x"`` every 20 ms until cancelled; the unary method answers ``b"bad"`` with
    INVALID_ARGUMENT and anything else never."""

    def __init__(self):
        self.open_streams = 0

    def service(self, details):
        if details.method == METHOD:
            async def stream(_requests, _context):
                self.open_streams += 1
                try:
                    while True:
                        yield b"x"
                        await asyncio.sleep(0.02)
                finally:
                    self.open_streams -= 1
            return grpc.stream_stream_rpc_method_handler(stream)
        if details.method == UNARY:
            async def unary(request, context):
                if request == b"bad":
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "target_text is empty")
                await asyncio.sleep(3600)
            return grpc.unary_unary_rpc_method_handler(unary)
        return None


class _Proc:
    """Stands in for the worker's ``asyncio.subprocess.Process``."""

    pid = 4242
    returncode: int | None = None

    async def wait(self) -> int:
        while self.returncode is None:
            await asyncio.sleep(0.01)
        return self.returncode


async def _setup():
    worker_port, router_port = free_ports(2)
    fake = _FakeWorker()
    worker_server = grpc.aio.server()
    worker_server.add_generic_rpc_handlers((fake,))
    worker_server.add_insecure_port(f"127.0.0.1:{worker_port}")
    await worker_server.start()
    router = Router(RouterConfig("127.0.0.1", 0, router_port, [WorkerSpec(0, [])]))
    w = router.workers[0]
    w.state, w.proc, w.generation = "ready", _Proc(), 1
    w.channel = grpc.aio.insecure_channel(f"127.0.0.1:{worker_port}")
    router_server = await start_router_grpc(router)
    client = grpc.aio.insecure_channel(f"127.0.0.1:{router_port}")
    return fake, worker_server, router, w, router_server, client


async def _teardown(worker_server, router, router_server, client):
    await client.close()
    await router_server.stop(0)
    await router._close_clients(router.workers[0])
    await worker_server.stop(0)


@pytest.mark.parametrize("first", ["channel_closed", "connection_broken"])
def test_lost_stream_ends_with_unavailable_whichever_is_noticed_first(first):
    async def go():
        fake, worker_server, router, w, router_server, client = await _setup()
        try:
            call = client.stream_stream(METHOD)(iter([b""]))
            got = 0
            async for _ in call:
                got += 1
                if got == 5:
                    break
            w.proc.returncode = -9  # the worker process "exited"
            if first == "channel_closed":
                w.state = "down"
                await router._close_clients(w)  # what the supervisor does after the exit
            else:
                await worker_server.stop(0)  # the connection breaks under the call
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(_drain(call), 10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
            assert "worker 0" in err.value.details() and "stopped" in err.value.details(), err.value.details()
            assert await _inflight_settles(w)
            assert router._m_lost.labels("0")._value.get() == 1
        finally:
            await _teardown(worker_server, router, router_server, client)
    asyncio.run(go())


async def _inflight_settles(w, timeout_s: float = 4.0) -> bool:
    """Whether ``w.inflight`` reaches 0 within ``timeout_s``: the proxy counts a call as ended in its own
    clean-up, which may run just after the client has received the call's status (a fresh-clone run under
    load saw 1 there)."""
    for _ in range(int(timeout_s / 0.02)):
        if w.inflight == 0:
            return True
        await asyncio.sleep(0.02)
    return w.inflight == 0


def test_lost_unary_call_ends_with_unavailable_when_its_channel_is_closed():
    async def go():
        fake, worker_server, router, w, router_server, client = await _setup()
        try:
            call = client.unary_unary(UNARY)(b"")
            await asyncio.sleep(0.3)  # the router forwarded it; the worker holds it
            assert w.inflight == 1
            w.proc.returncode = -9
            w.state = "down"
            await router._close_clients(w)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(call, 10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "worker 0" in err.value.details()
        finally:
            await _teardown(worker_server, router, router_server, client)
    asyncio.run(go())


def test_client_cancel_cancels_the_workers_stream_and_loses_nothing():
    async def go():
        fake, worker_server, router, w, router_server, client = await _setup()
        try:
            call = client.stream_stream(METHOD)(iter([b""]))
            await call.read()
            assert fake.open_streams == 1 and w.inflight == 1
            call.cancel()
            for _ in range(200):
                if fake.open_streams == 0 and w.inflight == 0:
                    break
                await asyncio.sleep(0.02)
            assert fake.open_streams == 0 and w.inflight == 0
            assert router._m_lost.labels("0")._value.get() == 0
            assert w.channel is not None  # the worker stays usable
        finally:
            await _teardown(worker_server, router, router_server, client)
    asyncio.run(go())


async def _drain(call) -> None:
    async for _ in call:
        pass


def test_worker_error_status_is_relayed_without_waiting_for_an_exit(monkeypatch):
    """A worker that answers with a status of its own (bad input: INVALID_ARGUMENT) is alive: the client gets
    that status, nothing is counted lost, and the proxy does not wait to see whether the worker exits (it waited
    2 s for every such error)."""
    import cosyserve.server.router as router_mod

    checked = []

    async def died(w, gen, grace_s=1.0):
        checked.append(grace_s)
        return False

    monkeypatch.setattr(router_mod, "died", died)

    async def go():
        fake, worker_server, router, w, router_server, client = await _setup()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(client.unary_unary(UNARY)(b"bad"), 10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == "target_text is empty"
            assert await _inflight_settles(w) and checked == []
            assert router._m_lost.labels("0")._value.get() == 0
        finally:
            await _teardown(worker_server, router, router_server, client)
    asyncio.run(go())
