"""Which drafter a process starts on: --drafter pretrained resolves to the head shipped for the model (its
sha256 checked), day0 where none ships; the store's current version wins over both."""

import hashlib
import json

import pytest
import torch

from specrl.config import Settings
from specrl.engine import start
from specrl.engine.start import DAY0, PRETRAINED, PRETRAINED_MANIFEST, start_weights
from specrl.errors import IncompatibleDrafterError
from specrl.models.drafter import CONFIG_FILE, WEIGHTS_FILE, DrafterConfig, EagleDrafter
from specrl.models.llama import LlamaConfig, load_llama
from specrl.weights import WeightsStore


@pytest.fixture
def shipped(tmp_path, tiny_dir, monkeypatch):
    """A head shipped for tiny-random in a shipped-drafters folder of the test's own."""
    monkeypatch.setattr(start, "SHIPPED_DRAFTERS", tmp_path / "drafters")
    directory = tmp_path / "drafters" / "tiny-random"
    EagleDrafter.day0(load_llama(tiny_dir), seed=5, draft_vocab_size=64).save(directory, int8_rows=True)
    digest = hashlib.sha256((directory / WEIGHTS_FILE).read_bytes()).hexdigest()
    (directory / PRETRAINED_MANIFEST).write_text(json.dumps({"weights_file": WEIGHTS_FILE, "sha256": digest}))
    return directory, digest


def test_pretrained_starts_on_the_shipped_head_under_its_sha(shipped, tiny_dir):
    directory, digest = shipped
    weights = start_weights(Settings.load(model="tiny-random", drafter=PRETRAINED), tiny_dir)
    assert weights.drafter == str(directory) and weights.drafter_version == f"pretrained-{digest[:12]}"
    drafter = start.build_drafter(weights.drafter, load_llama(tiny_dir), Settings.load(model="tiny-random"))
    assert drafter.cfg.draft_vocab_size == 64  # the shipped head's own vocabulary, not the setting's


def test_pretrained_is_day0_for_a_model_without_a_shipped_head(shipped, tiny_dir):
    settings = Settings.load(model=str(tiny_dir), drafter=PRETRAINED)  # a directory: no alias, no shipped head
    weights = start_weights(settings, tiny_dir)
    assert weights.drafter == DAY0 and weights.drafter_version == settings.drafter_version


def test_a_shipped_head_that_does_not_match_its_sha256_is_refused(shipped, tiny_dir):
    directory, _ = shipped
    data = bytearray((directory / WEIGHTS_FILE).read_bytes())
    data[-1] ^= 1
    (directory / WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(IncompatibleDrafterError, match="drafter.safetensors has sha256 .* --drafter day0"):
        start_weights(Settings.load(model="tiny-random", drafter=PRETRAINED), tiny_dir)
    (directory / PRETRAINED_MANIFEST).write_text("{not json")
    with pytest.raises(IncompatibleDrafterError, match="unreadable"):
        start_weights(Settings.load(model="tiny-random", drafter=PRETRAINED), tiny_dir)


def test_the_stores_current_drafter_wins_over_the_shipped_head(shipped, tiny_dir, tmp_path):
    store = WeightsStore(tmp_path / "store")
    online = tmp_path / "online"
    EagleDrafter.day0(load_llama(tiny_dir), seed=1).save(online)
    version = store.publish("drafter", online, make_current=True).version
    weights = start_weights(Settings.load(model="tiny-random", drafter=PRETRAINED), tiny_dir, store)
    assert weights.drafter_version == version and weights.drafter != str(shipped[0])


def test_the_default_drafter_is_pretrained():
    assert Settings().drafter == PRETRAINED


def test_the_head_shipped_for_smollm2_verifies_fits_and_was_trained(smollm_dir):
    directory = start.shipped_drafter("smollm2-135m")
    assert directory is not None and start.shipped_drafter("tiny-random") is None
    manifest = json.loads((directory / PRETRAINED_MANIFEST).read_text())
    assert start.verified_sha256(directory) == manifest["sha256"]
    DrafterConfig(**json.loads((directory / CONFIG_FILE).read_text())).check_fits(LlamaConfig.from_dir(smollm_dir))
    assert (directory / WEIGHTS_FILE).stat().st_size <= 10 * 2**20  # small enough to ship in the repository
    curve = manifest["curve"]
    assert curve[-1]["acceptance_length"] > curve[0]["acceptance_length"] + 0.3 and manifest["command"][1] == "pretrain-drafter"
