"""Admin weights API against a live server: auth, swaps, corrupt checkpoints, rollback."""

import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from specrl.models.drafter import EagleDrafter
from specrl.models.llama import load_llama
from specrl.weights import WeightsStore
from tests.serving.conftest import start_server

pytestmark = pytest.mark.redis
CHAT = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def live(home, tmp_path_factory, tiny_dir):
    srv = start_server(home, tmp_path_factory.mktemp("admin"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def drafter_dir(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter")
    EagleDrafter.day0(load_llama(tiny_dir), seed=5).save(out)
    return out


@pytest.fixture(scope="module")
def policy_dir(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("policy")
    for f in tiny_dir.iterdir():
        if f.suffix in (".json", ".jinja"):
            shutil.copy(f, out / f.name)
    gen = torch.Generator().manual_seed(3)
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def post(live, path, body, headers=None):
    return httpx.post(live.url + path, json=body, headers=headers if headers is not None else live.admin_headers(),
                      timeout=60)


def test_admin_needs_the_token(live):
    assert httpx.get(live.url + "/admin/weights").status_code == 401
    assert httpx.get(live.url + "/admin/weights", headers={"Authorization": "Bearer nope"}).status_code == 403
    assert httpx.get(live.url + "/admin/weights", headers=live.admin_headers()).status_code == 200


def test_admin_disabled_without_a_configured_token(home, tmp_path, tiny_dir):
    srv = start_server(home, tmp_path, admin=False)
    try:
        resp = httpx.get(srv.url + "/admin/weights", headers={"Authorization": "Bearer anything"})
        assert resp.status_code == 403 and "disabled" in resp.json()["error"]["message"]
    finally:
        srv.stop()


def test_drafter_swap_then_rollback(live, drafter_dir):
    store = WeightsStore(live.store)
    v1 = store.publish("drafter", drafter_dir).version
    v2 = store.publish("drafter", drafter_dir, parent=v1).version
    resp = post(live, "/admin/weights", {"role": "drafter", "version": v2})
    assert resp.status_code == 200, resp.text
    assert resp.json()["serving"]["drafter"] == v2 and resp.json()["load_ms"] >= 0
    chat = httpx.post(live.url + "/v1/chat/completions", json=CHAT).json()
    assert chat["system_fingerprint"] == f"specrl:target=base;drafter={v2}"
    assert store.current("drafter") == v2
    resp = post(live, "/admin/weights/rollback", {"role": "drafter"})
    assert resp.status_code == 200 and resp.json()["serving"]["drafter"] == v1
    listing = httpx.get(live.url + "/admin/weights", headers=live.admin_headers()).json()
    assert listing["serving"]["drafter"] == v1 and {m["version"] for m in listing["stored"]["drafter"]} >= {v1, v2}


def test_corrupt_checkpoint_keeps_the_old_weights(live, drafter_dir):
    store = WeightsStore(live.store)
    before = httpx.get(live.url + "/health").json()["drafter_version"]
    bad = store.publish("drafter", drafter_dir).version
    weights = live.store / "drafter" / bad / "drafter.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    resp = post(live, "/admin/weights", {"role": "drafter", "version": bad})
    assert 400 <= resp.status_code < 500 and "sha256" in resp.json()["error"]["message"]
    assert httpx.get(live.url + "/health").json()["drafter_version"] == before
    assert httpx.post(live.url + "/v1/chat/completions", json=CHAT).status_code == 200
    assert 'specrl_weight_swaps_total{result="failed",role="drafter"}' in httpx.get(live.url + "/metrics").text


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


def test_policy_swap_drain_changes_outputs_and_versions(live, policy_dir):
    store = WeightsStore(live.store)
    before = httpx.post(live.url + "/v1/chat/completions", json=CHAT).json()
    version = store.publish("policy", policy_dir, target_version=None).version
    resp = post(live, "/admin/weights", {"role": "policy", "version": version, "mode": "drain"})
    assert resp.status_code == 200, resp.text
    after = httpx.post(live.url + "/v1/chat/completions", json=CHAT).json()
    assert after["system_fingerprint"].startswith(f"specrl:target={version};")
    assert after["choices"][0]["message"]["content"] != before["choices"][0]["message"]["content"]
