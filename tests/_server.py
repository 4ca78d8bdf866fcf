"""Start the real ``cosyserve serve`` process for tests (shared by server and bench tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports of 127.0.0.1: each socket stays bound until all are chosen (two
    separate calls may get the same port back, which made a server bind HTTP and gRPC to one port)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Server:
    """``cosyserve serve --demo`` (or ``model`` arguments) on free ports of 127.0.0.1 (HTTP on ``port``
    when given, e.g. to restart a server on its port); waits until ready (or raises with its log)."""

    def __init__(self, tmp: Path, *extra: str, env: dict | None = None, model: tuple[str, ...] = ("--demo",),
                 port: int | None = None):
        if port is None:
            self.port, self.grpc_port = free_ports(2)
        else:
            self.port, self.grpc_port = port, next(p for p in free_ports(2) if p != port)
        self.url = f"http://127.0.0.1:{self.port}"
        self.grpc_url = f"grpc://127.0.0.1:{self.grpc_port}"
        self.cache = tmp / "cache"
        self.log = open(tmp / f"server-{self.port}.log", "w+")
        cmd = [sys.executable, "-m", "cosyserve.cli", "serve", *model, "--port", str(self.port), "--grpc-port",
               str(self.grpc_port), "--voices-dir", str(tmp / "voices"), *extra]
        e = dict(os.environ, COSYSERVE_CACHE_DIR=str(self.cache), **(env or {}))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=e)
        deadline = time.time() + 240
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + self.logs())
            try:
                if httpx.get(self.url + "/v2/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.proc.kill()
        raise RuntimeError("server did not become ready:\n" + self.logs())

    def logs(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def rss_bytes(self) -> int:
        """Resident set size of the server process (``VmRSS`` of ``/proc/<pid>/status``), bytes."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS line in /proc/<pid>/status")

    def kill(self) -> int:
        """SIGKILL (no cleanup at all, as a crash or the OOM killer); returns the exit status."""
        self.proc.kill()
        return self.proc.wait(timeout=30)

    def stop(self) -> int:
        """SIGTERM (graceful shutdown); returns the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
