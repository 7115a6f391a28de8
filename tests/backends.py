"""Live `specrl serve` processes for the serving tests, on either backend (native or vLLM).

- `start_server`: one `specrl serve` subprocess on a free loopback port; the caller stops it.
- `Backend`: what a test needs to know about the backend under test (the model it serves).
- `ServerPool`: at most one live server per configuration (`CONFIGS`), started on first use and
  stopped (exit status checked, Redis stream deleted) by `close`. A vLLM engine takes about a
  minute to start on two cores, so the whole test run shares one vLLM pool; the native backend
  gets a pool per test module. A test that ends a server (SIGTERM, engine death) `take`s it out
  of the pool; the next user gets a fresh one. The pool's first `get` starts every configuration
  the selected tests will ask for side by side (`together`): a server spends most of its start
  importing, on one core (measured on two cores, vLLM: 34 s + 37 s one after the other, 52 s
  together).
- `restore_versions`: put a server back on the versions it started with (policy "base", drafter
  "day0") where an earlier test swapped weights, so every test starts from a known server.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from specrl.apps.launch import free_port, spawn, terminate, wait_healthy
from specrl.telemetry import events_stream

REDIS_URL = "redis://127.0.0.1:6379/0"
DEAD_REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
ADMIN_TOKEN = "test-admin-token"
API_KEY = "test-api-key"  # the "bare" servers' (--api-key): their /v1 and tokenizer routes need it
API_HEADERS = {"Authorization": f"Bearer {API_KEY}"}
START_VERSIONS = {"policy": "base", "drafter": "day0"}  # what a server without a store serves
# a request SmolLM2 answers at length: greedy, it ends with "length" at 160 tokens (as any tiny-random answer does)
LONG_ANSWER = [{"role": "user", "content": "Write a long story about three colourful dragons."}]
# find_spec, not import: importing vllm into the test process changes torch's threading for every later test
VLLM_MARKS = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the [vllm] extra is not installed")]


@dataclass
class LiveServer:
    url: str
    proc: subprocess.Popen
    store: Path
    deployment: str
    log: Path

    @property
    def stream(self) -> str:
        return events_stream(self.deployment)

    def admin_headers(self) -> dict:
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        return terminate(self.proc, timeout, sig)


def start_server(home, tmp_path, *args: str, env: dict | None = None, admin: bool = True,
                 timeout_s: float = 120) -> LiveServer:
    server = spawn_server(home, tmp_path, *args, env=env, admin=admin)
    wait_healthy(server.url, server.proc, server.log, timeout_s=timeout_s)
    return server


def spawn_server(home, tmp_path, *args: str, env: dict | None = None, admin: bool = True) -> LiveServer:
    """A `specrl serve` process on a free port, not yet answering: `start_server` waits for it."""
    port, deployment = free_port(), f"test-{uuid.uuid4().hex[:12]}"
    store = tmp_path / "store"
    log = tmp_path / f"serve-{port}.log"
    full_env = {**os.environ, "SPECRL_HOME": str(home), "SPECRL_THREADS": "1", **(env or {})}
    if admin:
        full_env["SPECRL_ADMIN_TOKEN"] = ADMIN_TOKEN
    args = ["serve", "--model", "tiny-random", "--port", str(port), "--store", str(store), "--deployment", deployment,
            *args]
    return LiveServer(f"http://127.0.0.1:{port}", spawn(args, full_env, log), store, deployment, log)


@dataclass(frozen=True)
class Backend:
    """The serving backend under test. vLLM serves SmolLM2: its CPU attention has no kernel for
    tiny-random's head size 16."""

    name: str  # "native" | "vllm"
    model: str  # the alias it serves (the `model` of every request)
    model_dir: Path
    args: tuple[str, ...] = ()  # `specrl serve` arguments of every server of this backend
    start_timeout_s: float = 120


def native_backend(tiny_dir: Path) -> Backend:
    return Backend("native", "tiny-random", tiny_dir)


def vllm_backend(smollm_dir: Path) -> Backend:
    return Backend("vllm", "smollm2-135m", smollm_dir,
                   ("--backend", "vllm", "--model", "smollm2-135m", "--max-batch", "4",
                    "--fixed-draft-tokens", "4"), start_timeout_s=300)


@dataclass(frozen=True)
class ServerConfig:
    args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    admin: bool = True


CONFIGS = {
    # the API and admin suite: a drafter, events in Redis, the admin API on
    "shared": ServerConfig(("--redis-url", REDIS_URL)),
    # every other way to start, in one server (a vLLM engine per setting would cost a minute each):
    # no drafter, no admin token, an API key, Redis unreachable, one running and one waiting request
    # at most (on vLLM with a KV cache sized for that one request, not the default 1 GiB)
    "bare": ServerConfig(("--drafter", "none", "--redis-url", DEAD_REDIS_URL, "--max-batch", "1",
                          "--api-key", API_KEY),
                         {"SPECRL_MAX_WAITING": "1", "SPECRL_VLLM_KV_CACHE_MB": "256"}, admin=False),
}


class ServerPool:
    def __init__(self, backend: Backend, home: Path, tmp_root: Path, together: tuple[str, ...] = ()):
        """together: the configurations the pool's first start starts with the one asked for (and
        waits for: no start-up competes with a test for the cores)."""
        self.backend, self.home, self.tmp_root, self.together = backend, home, tmp_root, together
        self.live: dict[str, LiveServer] = {}
        self.started: list[LiveServer] = []

    def get(self, config: str, alone: bool = False) -> LiveServer:
        """The pool's live server of `config` (started now if there is none or it has exited; the
        pool's first start also starts `together`, unless alone)."""
        server = self.live.get(config)
        if server is None or server.proc.poll() is not None:
            others = [] if alone or self.started else [c for c in self.together if c != config]
            spawned = {c: self._spawn(c) for c in [config, *others]}
            for c, new in spawned.items():
                wait_healthy(new.url, new.proc, new.log, timeout_s=self.backend.start_timeout_s)
                self.live[c] = new
            server = spawned[config]
        return server

    def _spawn(self, config: str) -> LiveServer:
        cfg = CONFIGS[config]
        tmp = Path(tempfile.mkdtemp(prefix=f"{self.backend.name}-{config}-", dir=self.tmp_root))
        server = spawn_server(self.home, tmp, *self.backend.args, *cfg.args, env=cfg.env, admin=cfg.admin)
        self.started.append(server)
        return server

    def take(self, config: str) -> LiveServer:
        """The server of `config`, out of the pool: the caller ends it."""
        server = self.get(config, alone=True)  # a test run last may find its module's pool new
        del self.live[config]
        return server

    def close(self) -> None:
        """Stop the pool's servers, delete every stream it created; then check they exited cleanly."""
        codes = {config: server.stop() for config, server in self.live.items()}
        client = redis.Redis.from_url(REDIS_URL)
        for server in self.started:
            terminate(server.proc)  # a taken server its test left running
            client.delete(server.stream)
        unclean = {config: code for config, code in codes.items() if code != 0}
        assert not unclean, (unclean, [self.live[c].log.read_text()[-3000:] for c in unclean])


def publish_start_version(store_root: Path, model_dir: Path, role: str) -> None:
    """Publish the `role` version a fresh server serves into its store, unless already there:
    policy "base" (the model's files) or drafter "day0" (the untrained drafter it builds at start)."""
    from specrl.weights import WeightsStore

    store, version = WeightsStore(store_root), START_VERSIONS[role]
    if version in {m.version for m in store.versions(role)}:
        return
    if role == "policy":
        store.publish("policy", model_dir, version=version)
        return
    from specrl.config import Settings
    from specrl.engine.start import DAY0, build_drafter
    from specrl.models.llama import load_llama

    settings = Settings.load(model=str(model_dir), drafter=DAY0)
    with tempfile.TemporaryDirectory(prefix="specrl-day0-") as tmp:
        build_drafter(DAY0, load_llama(model_dir), settings).save(Path(tmp))
        store.publish("drafter", tmp, version=version)


def restore_versions(server: LiveServer, model_dir: Path) -> None:
    """Swap `server` back to the versions it started with, where an earlier test left others serving."""
    health = httpx.get(server.url + "/health", timeout=30).json()
    serving = {"policy": health["target_version"], "drafter": health["drafter_version"]}
    for role, version in START_VERSIONS.items():
        if serving[role] != version:
            publish_start_version(server.store, model_dir, role)
            resp = httpx.post(server.url + "/admin/weights", json={"role": role, "version": version, "mode": "drain"},
                              headers=server.admin_headers(), timeout=300)
            assert resp.status_code == 200, resp.text
