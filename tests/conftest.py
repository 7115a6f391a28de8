"""Shared fixtures: models come from the cache home (SPECRL_HOME, else ~/.cache/specrl);
`make test` fetches them first, and a missing one is fetched on first use.

Live servers (tests/backends.py): a test that takes `backend` runs once per serving backend,
native and vLLM; `live` is that backend's shared server, `bare` its server started every other
way. One vLLM pool serves the whole run; tests marked `ends_server` run last."""

from __future__ import annotations

import pytest
import torch

from specrl.assets import fetch_model
from specrl.config import Settings
from specrl.engine.engine import Engine
from specrl.telemetry.sink import MemorySink
from tests.backends import VLLM_MARKS, ServerPool, native_backend, restore_versions, vllm_backend

BACKENDS = ["native", pytest.param("vllm", marks=VLLM_MARKS)]


def pytest_configure(config):
    config.addinivalue_line("markers", "ends_server: takes a server out of its pool and ends it (runs last)")


@pytest.hookimpl(trylast=True)  # after pytest has grouped the items by parameter
def pytest_collection_modifyitems(items):
    """Tests that end a pooled server run after every test that shares it (a stable sort)."""
    items.sort(key=lambda item: item.get_closest_marker("ends_server") is not None)


@pytest.fixture(scope="session")
def home():
    return Settings.load().home


@pytest.fixture(scope="session")
def tiny_dir(home):
    return fetch_model("tiny-random", home, progress=False)


@pytest.fixture(scope="session")
def smollm_dir(home):
    return fetch_model("smollm2-135m", home, progress=False)


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


@pytest.fixture
def make_engine(home):
    """make_engine(model="tiny-random", drafter="day0", **settings) -> Engine with a MemorySink."""

    def make(model="tiny-random", drafter="day0", **overrides):
        settings = Settings.load(home=home, model=model, drafter=drafter, **overrides)
        return Engine.from_settings(settings, sink=MemorySink(), progress=False)

    return make


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    """The serving backend under test (tests/backends.py: `Backend`)."""
    if request.param == "vllm":
        return vllm_backend(request.getfixturevalue("smollm_dir"))
    return native_backend(request.getfixturevalue("tiny_dir"))


POOLED = {"live": "shared", "bare": "bare"}  # fixture -> the pool configuration it serves


def asked_configs(items) -> tuple[str, ...]:
    """The pool configurations these test items ask for by fixture: a pool starts them together."""
    names = {name for item in items for name in item.fixturenames}
    return tuple(config for fixture, config in POOLED.items() if fixture in names)


@pytest.fixture(scope="session")
def vllm_servers(request, home, tmp_path_factory, smollm_dir):
    """The one vLLM server pool of the test run (engines start on first use)."""
    together = asked_configs(item for item in request.session.items if item.get_closest_marker("vllm"))
    pool = ServerPool(vllm_backend(smollm_dir), home, tmp_path_factory.mktemp("vllm"), together)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def servers(request, backend, home, tmp_path_factory):
    """The backend's server pool: the session's for vLLM, this module's for native."""
    if backend.name == "vllm":
        yield request.getfixturevalue("vllm_servers")
        return
    together = asked_configs(item for item in request.session.items if item.module is request.module
                             and getattr(item, "callspec", None) and item.callspec.params.get("backend") == "native")
    pool = ServerPool(backend, home, tmp_path_factory.mktemp("native"), together)
    yield pool
    pool.close()


@pytest.fixture
def live(servers, backend):
    """The backend's shared server (drafter, Redis, admin token), on the versions it started with."""
    server = servers.get("shared")
    restore_versions(server, backend.model_dir)
    return server


@pytest.fixture
def bare(servers):
    """The backend's server without drafter, admin token or reachable Redis, one request at a time."""
    return servers.get("bare")
