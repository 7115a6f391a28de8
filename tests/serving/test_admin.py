"""Admin weights API against a live server of each backend: auth, swaps, corrupt checkpoints, rollback."""

import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from specrl.models.drafter import WEIGHTS_FILE, EagleDrafter
from specrl.models.llama import load_llama
from specrl.weights import WeightsStore
from tests.backends import publish_start_version

pytestmark = pytest.mark.redis


@pytest.fixture
def chat(backend):
    return {"model": backend.model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def drafter_dir(backend, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter")
    EagleDrafter.day0(load_llama(backend.model_dir), seed=5).save(out)
    return out


@pytest.fixture(scope="module")
def policy_dir(backend, tmp_path_factory):
    out = tmp_path_factory.mktemp("policy")
    for f in backend.model_dir.iterdir():
        if f.suffix in (".json", ".jinja") and f.name != "manifest.json":
            shutil.copy(f, out / f.name)
    gen = torch.Generator().manual_seed(3)
    for f in backend.model_dir.glob("*.safetensors"):
        tensors = load_file(str(f))
        save_file({k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in tensors.items()}, str(out / f.name))
    return out


def post(live, path, body, headers=None):
    return httpx.post(live.url + path, json=body, headers=headers if headers is not None else live.admin_headers(),
                      timeout=120)


def generate(live, chat) -> dict:
    resp = httpx.post(live.url + "/v1/chat/completions", json=chat, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_admin_needs_the_token(live):
    assert httpx.get(live.url + "/admin/weights").status_code == 401
    assert httpx.get(live.url + "/admin/weights", headers={"Authorization": "Bearer nope"}).status_code == 403
    assert httpx.get(live.url + "/admin/weights", headers=live.admin_headers()).status_code == 200


def test_admin_disabled_without_a_configured_token(bare):
    resp = httpx.get(bare.url + "/admin/weights", headers={"Authorization": "Bearer anything"})
    assert resp.status_code == 403 and "disabled" in resp.json()["error"]["message"]


def test_drafter_swap_then_rollback(live, drafter_dir, chat):
    store = WeightsStore(live.store)
    v1 = store.publish("drafter", drafter_dir).version
    v2 = store.publish("drafter", drafter_dir, parent=v1).version
    resp = post(live, "/admin/weights", {"role": "drafter", "version": v2})
    assert resp.status_code == 200, resp.text
    assert resp.json()["serving"]["drafter"] == v2 and resp.json()["load_ms"] >= 0
    assert generate(live, chat)["system_fingerprint"] == f"specrl:target=base;drafter={v2}"
    assert store.current("drafter") == v2
    resp = post(live, "/admin/weights/rollback", {"role": "drafter"})
    assert resp.status_code == 200 and resp.json()["serving"]["drafter"] == v1
    listing = httpx.get(live.url + "/admin/weights", headers=live.admin_headers()).json()
    assert listing["serving"]["drafter"] == v1 and {m["version"] for m in listing["stored"]["drafter"]} >= {v1, v2}


def test_corrupt_checkpoint_keeps_the_old_weights(live, drafter_dir, chat):
    store = WeightsStore(live.store)
    before = httpx.get(live.url + "/health").json()["drafter_version"]
    bad = store.publish("drafter", drafter_dir).version
    weights = live.store / "drafter" / bad / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    resp = post(live, "/admin/weights", {"role": "drafter", "version": bad})
    assert 400 <= resp.status_code < 500 and "sha256" in resp.json()["error"]["message"]
    assert httpx.get(live.url + "/health").json()["drafter_version"] == before
    generate(live, chat)
    assert 'specrl_weight_swaps_total{result="failed",role="drafter"}' in httpx.get(live.url + "/metrics").text


def test_non_finite_drafter_is_refused_and_the_old_weights_keep_serving(live, drafter_dir, chat, tmp_path):
    """A checkpoint whose sha256 fits its manifest but whose values are NaN (a diverged trainer)."""
    shutil.copytree(drafter_dir, tmp_path / "nan")
    tensors = load_file(str(tmp_path / "nan" / WEIGHTS_FILE))
    tensors["fc"] = torch.full_like(tensors["fc"], float("nan"))
    save_file(tensors, str(tmp_path / "nan" / WEIGHTS_FILE))
    before = generate(live, chat)
    version = WeightsStore(live.store).publish("drafter", tmp_path / "nan").version
    resp = post(live, "/admin/weights", {"role": "drafter", "version": version})
    assert 400 <= resp.status_code < 500 and "NaN" in resp.json()["error"]["message"], resp.text
    assert httpx.get(live.url + "/health").json()["drafter_version"] == "day0"
    after = generate(live, chat)
    assert after["choices"][0]["message"]["content"] == before["choices"][0]["message"]["content"]
    assert after["system_fingerprint"] == before["system_fingerprint"]


@pytest.mark.parametrize("body,status", [
    ({"role": "drafter", "version": "../../etc"}, 400),
    ({"role": "drafter", "version": "v999"}, 404),
    ({"role": "tokenizer", "version": "v1"}, 400),
    ({"role": "policy", "version": "v1", "mode": "yolo"}, 400),
])
def test_swap_requests_that_name_nothing_valid(live, body, status):
    resp = post(live, "/admin/weights", body)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["message"]


def test_policy_swap_changes_outputs_and_versions_and_swapping_back_restores_them(live, policy_dir, backend, chat):
    """drain to perturbed weights, then interrupt back to the model's own files: the same outputs as before."""
    store = WeightsStore(live.store)
    before = generate(live, chat)
    version = store.publish("policy", policy_dir, target_version=None).version
    resp = post(live, "/admin/weights", {"role": "policy", "version": version, "mode": "drain"})
    assert resp.status_code == 200, resp.text
    after = generate(live, chat)
    assert after["system_fingerprint"].startswith(f"specrl:target={version};")
    assert after["choices"][0]["message"]["content"] != before["choices"][0]["message"]["content"]
    publish_start_version(live.store, backend.model_dir, "policy")
    resp = post(live, "/admin/weights", {"role": "policy", "version": "base", "mode": "interrupt"})
    assert resp.status_code == 200, resp.text
    back = generate(live, chat)
    assert back["system_fingerprint"] == before["system_fingerprint"] == "specrl:target=base;drafter=day0"
    assert back["choices"][0]["message"]["content"] == before["choices"][0]["message"]["content"]
