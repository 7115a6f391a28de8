"""A live `specrl serve` subprocess on a free loopback port, stopped by the test that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from specrl.launch import free_port, spawn, terminate, wait_healthy

REDIS_URL = "redis://127.0.0.1:6379/0"
ADMIN_TOKEN = "test-admin-token"


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
        return terminate(self.proc, timeout, sig)


def start_server(home, tmp_path, *args: str, env: dict | None = None, admin: bool = True,
                 timeout_s: float = 120) -> LiveServer:
    port, deployment = free_port(), f"test-{uuid.uuid4().hex[:12]}"
    store = tmp_path / "store"
    log = tmp_path / f"serve-{port}.log"
    full_env = {**os.environ, "SPECRL_HOME": str(home), "SPECRL_THREADS": "1", **(env or {})}
    if admin:
        full_env["SPECRL_ADMIN_TOKEN"] = ADMIN_TOKEN
    args = ["serve", "--model", "tiny-random", "--port", str(port), "--store", str(store), "--deployment", deployment,
            *args]
    server = LiveServer(f"http://127.0.0.1:{port}", spawn(args, full_env, log), store, deployment, log)
    wait_healthy(server.url, server.proc, log, timeout_s=timeout_s)
    return server


@pytest.fixture(scope="module")
def server(home, tmp_path_factory, tiny_dir):
    srv = start_server(home, tmp_path_factory.mktemp("server"), "--redis-url", REDIS_URL)
    yield srv
    srv.stop()
    import redis

    redis.Redis.from_url(REDIS_URL).delete(srv.stream)
