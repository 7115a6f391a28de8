"""Shared fixtures: models come from the cache home (SPECRL_HOME, else ~/.cache/specrl);
`make test` fetches them first, and a missing one is fetched on first use."""

from __future__ import annotations

import pytest
import torch

from specrl.assets import fetch_model
from specrl.config import Settings
from specrl.serving.engine import Engine
from specrl.telemetry.sink import MemorySink


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
