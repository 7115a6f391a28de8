"""The OpenAI-compatible API against a live server of each backend, through the official `openai` client."""

import json
import time

import httpx
import openai
import pytest
import redis

from specrl.telemetry import SegmentRecord
from tests.backends import LONG_ANSWER, REDIS_URL

pytestmark = pytest.mark.redis


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def model(backend):
    return backend.model


MESSAGES = LONG_ANSWER  # finish_reason "length" at every max_tokens used here


def test_models(client, model):
    assert [m.id for m in client.models.list()] == [model]


def test_chat_reports_versions_and_spec_stats(client, model):
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 12
    assert resp.system_fingerprint == "specrl:target=base;drafter=day0"
    extra = resp.model_dump()["specrl"]
    assert extra["spec_decode"]["num_draft_tokens"] >= extra["spec_decode"]["num_accepted_tokens"] >= 0
    assert extra["versions"] == [[[0, "base", "day0"]]]


def test_streaming_equals_non_streaming_and_ends_with_usage(client, model):
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.system_fingerprint == "specrl:target=base;drafter=day0" for c in chunks)


def test_completions_n_seed_and_logprobs(client, model):
    resp = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, n=2,
                                     temperature=1.0, seed=7, logprobs=3)
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.choices[0].text != resp.choices[1].text  # n samples differ
    lp = resp.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(top) == 3 for top in lp.top_logprobs)


def test_chat_logprobs(client, model):
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:  # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)


def test_stop_string_is_not_returned(client, model):
    full = client.completions.create(model=model, prompt="Hello", max_tokens=12, temperature=0).choices[0].text
    stop = full[4:8]
    cut = client.completions.create(model=model, prompt="Hello", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body,status,fragment", [  # the served model unless the body names one
    ({"model": "gpt-4", "messages": MESSAGES}, 404, "does not exist"),
    ({"messages": MESSAGES, "n": 100}, 400, "n"),
    ({"messages": MESSAGES, "max_tokens": 10 ** 6}, 400, "exceeds the context"),
    ({"messages": MESSAGES, "temperature": "hot"}, 400, "temperature"),
    ({"messages": MESSAGES, "frobnicate": 1}, 400, "unsupported parameter: frobnicate"),
    ({"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": []}, 400, "messages"),
    ({}, 400, "messages"),
])
def test_bad_requests_get_openai_shaped_errors(live, model, body, status, fragment):
    resp = httpx.post(live.url + "/v1/chat/completions", json={"model": model, **body}, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert fragment in error["message"] and error["type"]


def test_malformed_json_and_oversized_body(live, model):
    resp = httpx.post(live.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "the request body is not valid JSON"
    huge = json.dumps({"model": model, "prompt": "x" * (2 << 20)})
    resp = httpx.post(live.url + "/v1/completions", content=huge, headers={"content-type": "application/json"})
    assert resp.status_code == 413 and "request body over" in resp.json()["error"]["message"]


def test_prompt_longer_than_context(live, model):
    resp = httpx.post(live.url + "/v1/completions", json={"model": model, "prompt": [1] * 5000})
    assert resp.status_code == 400 and "the context is" in resp.json()["error"]["message"]


def test_every_request_leaves_records_in_redis(live, client, model):
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=70, temperature=0)
    rid = resp.id
    r = redis.Redis.from_url(REDIS_URL)
    deadline = time.monotonic() + 30
    records = []
    while time.monotonic() < deadline:
        records = [SegmentRecord.from_msgpack(f[b"r"]) for _, f in r.xrange(live.stream)]
        records = [x for x in records if x.request_id.startswith(rid)]
        if records and records[-1].finish_reason:
            break
        time.sleep(0.1)
    assert [x.segment for x in records] == list(range(len(records))) and records[-1].finish_reason == "length"
    first = records[0]
    assert first.deployment == live.deployment and first.prompt_ids
    assert {(x.target_version, x.drafter_version) for x in records} == {("base", "day0")}
    assert sum(len(x.tokens) for x in records) >= 70
    steps = [s for x in records for s in x.steps]
    assert any(s.k > 0 for s in steps) and all(len(s.draft_tokens) == s.k and 0 <= s.accepted <= s.k for s in steps)
    for x in records:  # the record invariant: committed tokens = accepted drafts + the target's token, step by step
        assert [t for s in x.steps for t in s.draft_tokens[: s.accepted] + [s.target_token]] == x.tokens


def test_metrics_use_vllm_names(live, client, model):
    client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    text = httpx.get(live.url + "/metrics").text
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "specrl_time_to_first_token_seconds_bucket",
                 "specrl_inter_token_latency_seconds_bucket", 'specrl_weight_version_info{role="policy",version="base"}',
                 "specrl_telemetry_records_sent_total", "specrl_requests_total"):
        assert name in text, name
