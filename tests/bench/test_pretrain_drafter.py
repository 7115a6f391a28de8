"""`specrl pretrain-drafter` on the tiny model: one head trained on recorded traffic, written compact with a
manifest whose sha256 `--drafter pretrained` checks, and served from there."""

import hashlib
import json

import pytest
import torch

from specrl.apps.cli import main
from specrl.apps.pretrain_drafter import plot_curve, pretrain_drafter
from specrl.config import Settings
from specrl.engine import start
from specrl.engine.engine import Engine
from specrl.engine.start import PRETRAINED_MANIFEST
from specrl.errors import InvalidRequestError
from specrl.models.drafter import INT8_ROWS, WEIGHTS_FILE, EagleDrafter
from specrl.models.llama import load_llama
from specrl.speculation.sampling import SamplingParams


def test_pretrain_drafter_writes_a_head_that_pretrained_serves(home, tiny_dir, tmp_path, traffic_cache, monkeypatch):
    settings = Settings.load(home=home, model="tiny-random", train_records=2, draft_vocab_size=64)
    out = tmp_path / "drafters" / "tiny-random"
    manifest = pretrain_drafter(settings, out, minutes=0.03, prompts=4, heldout=2, max_tokens=24, eval_every_s=1.0)
    chart = plot_curve(manifest, tmp_path / "curve.png")  # what the command draws under <home>/reports
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    weights = (out / WEIGHTS_FILE).read_bytes()
    assert manifest == json.loads((out / PRETRAINED_MANIFEST).read_text())
    assert manifest["sha256"] == hashlib.sha256(weights).hexdigest() and manifest["weights_bytes"] == len(weights)
    assert manifest["objective"] == "kl" and manifest["vocabulary"] == "first64" and manifest["steps"] > 0
    assert manifest["curve"][-1]["cpu_s"] >= 0.03 * 60 and manifest["machine"]["read_gb_s"] > 0
    assert manifest["traffic"]["train_records"] > 0 and manifest["command"][0] == "specrl"
    trained = EagleDrafter.load(out, load_llama(tiny_dir))
    untrained = EagleDrafter.day0(load_llama(tiny_dir), seed=settings.seed, draft_vocab_size=64)
    assert not torch.equal(trained.fc, untrained.fc)  # trained, not the day-0 start

    monkeypatch.setattr(start, "SHIPPED_DRAFTERS", tmp_path / "drafters")
    engine = Engine.from_settings(settings.replace(drafter="pretrained"))
    assert engine.drafter_version == f"pretrained-{manifest['sha256'][:12]}"
    plain = Engine(engine.target, engine.tokenizer, settings.replace(drafter="none", suffix_capacity=0))
    params = SamplingParams(max_tokens=16, temperature=0.0)
    prompt = [[1, 2, 3, 4, 5]]
    assert engine.generate(prompt, params)[0].output_ids == plain.generate(prompt, params)[0].output_ids


def test_pretrain_drafter_refuses_bad_numbers(home, tmp_path, capsys):
    with pytest.raises(InvalidRequestError, match="--minutes"):
        pretrain_drafter(Settings.load(home=home, model="tiny-random"), tmp_path, minutes=0, prompts=4, heldout=2,
                         max_tokens=8, eval_every_s=1.0)
    assert main(["pretrain-drafter", "--model", "tiny-random", "--home", str(home), "--prompts", "0",
                 "--out", str(tmp_path)]) == 1
    assert "must be > 0" in capsys.readouterr().err


def test_int8_rows_weights_load_close_to_the_saved_ones(tiny_dir, tmp_path):
    drafter = EagleDrafter.day0(load_llama(tiny_dir), seed=2, draft_vocab_size=64)
    drafter.save(tmp_path / "full")
    drafter.save(tmp_path / "compact", int8_rows=True)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "compact" / WEIGHTS_FILE), "pt") as f:
        assert f.metadata()["format"] == INT8_ROWS and f.get_tensor("fc").dtype == torch.int8
    assert (tmp_path / "compact" / WEIGHTS_FILE).stat().st_size < 0.4 * (tmp_path / "full" / WEIGHTS_FILE).stat().st_size
    loaded = EagleDrafter.load(tmp_path / "compact", load_llama(tiny_dir))
    for name, value in drafter.state_dict().items():
        got = loaded.state_dict()[name]
        if value.dim() == 2:  # within half a step of its row's int8 grid
            assert (got - value).abs().max() <= value.abs().amax().item() / 254 + 1e-7, name
        else:
            assert torch.equal(got, value), name


def test_a_drafter_file_that_is_not_safetensors_is_one_clear_error(tiny_dir, tmp_path):
    from specrl.errors import IncompatibleDrafterError

    EagleDrafter.day0(load_llama(tiny_dir)).save(tmp_path)
    (tmp_path / WEIGHTS_FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(IncompatibleDrafterError, match="not a drafter weights file"):
        EagleDrafter.load(tmp_path, load_llama(tiny_dir))
