"""The OpenAI-compatible API against a live server, through the official `openai` client."""

import json

import httpx
import openai
import pytest
import redis

from specrl.telemetry import SegmentRecord
from tests.serving.conftest import REDIS_URL

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "user", "content": "Name three colours."}]


def test_models(client):
    assert [m.id for m in client.models.list()] == ["tiny-random"]


def test_chat_reports_versions_and_spec_stats(client):
    resp = client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=12, temperature=0)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 12
    assert resp.system_fingerprint == "specrl:target=base;drafter=day0"
    extra = resp.model_dump()["specrl"]
    assert extra["spec_decode"]["num_draft_tokens"] >= extra["spec_decode"]["num_accepted_tokens"] >= 0
    assert extra["versions"] == [[[0, "base", "day0"]]]


def test_streaming_equals_non_streaming_and_ends_with_usage(client):
    full = client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.system_fingerprint == "specrl:target=base;drafter=day0" for c in chunks)


def test_completions_n_seed_and_logprobs(client):
    resp = client.completions.create(model="tiny-random", prompt="Once upon a time", max_tokens=6, n=2,
                                     temperature=1.0, seed=7, logprobs=3)
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.choices[0].text != resp.choices[1].text  # n samples differ
    lp = resp.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(top) == 3 for top in lp.top_logprobs)


def test_chat_logprobs(client):
    resp = client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:  # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)


def test_stop_string_is_not_returned(client):
    full = client.completions.create(model="tiny-random", prompt="Hello", max_tokens=12, temperature=0).choices[0].text
    stop = full[4:8]
    cut = client.completions.create(model="tiny-random", prompt="Hello", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body,status,fragment", [
    ({"model": "gpt-4", "messages": MESSAGES}, 404, "does not exist"),
    ({"model": "tiny-random", "messages": MESSAGES, "n": 100}, 400, "n"),
    ({"model": "tiny-random", "messages": MESSAGES, "max_tokens": 10 ** 6}, 400, "exceeds the context"),
    ({"model": "tiny-random", "messages": MESSAGES, "temperature": "hot"}, 400, "temperature"),
    ({"model": "tiny-random", "messages": MESSAGES, "frobnicate": 1}, 400, "unsupported parameter: frobnicate"),
    ({"model": "tiny-random", "messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tools"),
    ({"model": "tiny-random", "messages": []}, 400, "messages"),
    ({"model": "tiny-random"}, 400, "messages"),
])
def test_bad_requests_get_openai_shaped_errors(server, body, status, fragment):
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert fragment in error["message"] and error["type"]


def test_malformed_json_and_oversized_body(server):
    resp = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "the request body is not valid JSON"
    huge = json.dumps({"model": "tiny-random", "prompt": "x" * (2 << 20)})
    resp = httpx.post(server.url + "/v1/completions", content=huge, headers={"content-type": "application/json"})
    assert resp.status_code == 413 and "request body over" in resp.json()["error"]["message"]


def test_prompt_longer_than_context(server):
    resp = httpx.post(server.url + "/v1/completions", json={"model": "tiny-random", "prompt": [1] * 5000})
    assert resp.status_code == 400 and "the context is" in resp.json()["error"]["message"]


def test_every_request_leaves_records_in_redis(server, client):
    resp = client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=70, temperature=0)
    rid = resp.id
    r = redis.Redis.from_url(REDIS_URL)
    import time

    deadline = time.monotonic() + 30
    records = []
    while time.monotonic() < deadline:
        records = [SegmentRecord.from_msgpack(f[b"r"]) for _, f in r.xrange(server.stream)]
        records = [x for x in records if x.request_id.startswith(rid)]
        if records and records[-1].finish_reason:
            break
        time.sleep(0.1)
    assert [x.segment for x in records] == list(range(len(records))) and records[-1].finish_reason == "length"
    assert records[0].deployment == server.deployment
    assert sum(len(x.tokens) for x in records) >= 70


def test_metrics_use_vllm_names(server, client):
    client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=8, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "specrl_time_to_first_token_seconds_bucket",
                 "specrl_inter_token_latency_seconds_bucket", 'specrl_weight_version_info{role="policy",version="base"}',
                 "specrl_telemetry_records_sent_total", "specrl_requests_total"):
        assert name in text, name
