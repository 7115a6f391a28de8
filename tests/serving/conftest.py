"""A live `specrl serve` subprocess on a free loopback port, stopped by the test that started it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REDIS_URL = "redis://127.0.0.1:6379/0"
ADMIN_TOKEN = "test-admin-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    proc: subprocess.Popen
    store: Path
    deployment: str
    log: Path

    @property
    def stream(self) -> str:
        return f"specrl:{self.deployment}:events"

    def admin_headers(self) -> dict:
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(home, tmp_path, *args: str, env: dict | None = None, admin: bool = True) -> LiveServer:
    port, deployment = free_port(), f"test-{uuid.uuid4().hex[:12]}"
    store = tmp_path / "store"
    log = tmp_path / f"serve-{port}.log"
    full_env = {**os.environ, "SPECRL_HOME": str(home), "SPECRL_THREADS": "1", **(env or {})}
    if admin:
        full_env["SPECRL_ADMIN_TOKEN"] = ADMIN_TOKEN
    cmd = [sys.executable, "-m", "specrl.cli", "serve", "--model", "tiny-random", "--port", str(port),
           "--store", str(store), "--deployment", deployment, *args]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=full_env)
    server = LiveServer(f"http://127.0.0.1:{port}", proc, store, deployment, log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server did not become healthy:\n{log.read_text()}")


@pytest.fixture(scope="module")
def server(home, tmp_path_factory, tiny_dir):
    srv = start_server(home, tmp_path_factory.mktemp("server"), "--redis-url", REDIS_URL)
    yield srv
    srv.stop()
    import redis

    redis.Redis.from_url(REDIS_URL).delete(srv.stream)
