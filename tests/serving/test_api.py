"""The OpenAI-compatible API against a live server of each backend, through the official `openai` client."""

import copy
import json
import time

import httpx
import openai
import pytest
import redis

from specrl.errors import InvalidRequestError
from specrl.serving.openai_api import _chat_prompt
from specrl.serving.protocol import ChatMessage
from specrl.telemetry import SegmentRecord
from tests.backends import API_HEADERS, API_KEY, LONG_ANSWER, REDIS_URL

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
                 "specrl_telemetry_records_sent_total", "specrl_requests_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        assert name in text, name


def test_prefix_cache_hits_are_exported_under_vllms_names(live, client, model):
    """The same long prompt twice: the second reuses the first's KV (both backends: the native prefix
    cache, vLLM's own), counted in prompt tokens."""
    from specrl.apps.bench.serve import prometheus_value

    def counters() -> tuple[float, float]:
        text = httpx.get(live.url + "/metrics").text
        return (prometheus_value(text, "vllm:prefix_cache_queries_total"),
                prometheus_value(text, "vllm:prefix_cache_hits_total"))

    prompt = " ".join(f"word{i}" for i in range(300))  # several of vLLM's KV blocks (16 or 128 tokens)
    client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    queries, hits = counters()
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    after = counters()
    assert after[0] - queries == resp.usage.prompt_tokens
    assert after[1] - hits >= resp.usage.prompt_tokens // 2


# ---- vLLM's extra sampling parameters --------------------------------------------------------

@pytest.fixture
def steer(backend, request):
    """A client of a server that takes min_p and logit_bias: the shared one (speculating) on native;
    on vLLM, which refuses both under speculative decoding, the one without a drafter."""
    if backend.name == "native":
        return request.getfixturevalue("client")
    return openai.OpenAI(base_url=request.getfixturevalue("bare").url + "/v1", api_key=API_KEY, max_retries=0)


EXTRA = {"top_k": 20, "repetition_penalty": 1.1, "min_tokens": 4, "ignore_eos": True, "stop_token_ids": [7],
         "include_stop_str_in_output": False, "skip_special_tokens": True, "spaces_between_special_tokens": True}


def test_vllm_sampling_parameters_are_accepted(client, model):
    resp = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0.8, seed=3,
                                     presence_penalty=0.5, frequency_penalty=0.5, extra_body=EXTRA)
    assert resp.usage.completion_tokens >= 4 and resp.choices[0].finish_reason in ("length", "stop")
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0,
                                          extra_body={**EXTRA, "top_k": None, "min_p": None})  # null: the default
    assert resp.choices[0].finish_reason in ("length", "stop")


def test_min_p_and_logit_bias(steer, model):
    resp = steer.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0.8, seed=3,
                                    logit_bias={"42": 1.0}, extra_body={**EXTRA, "min_p": 0.05})
    assert resp.usage.completion_tokens >= 4


def test_vllm_with_a_drafter_refuses_min_p_and_logit_bias_naming_them(live, model, backend):
    """vLLM 0.32 refuses both under speculative decoding: a 400 before any work (native takes them)."""
    for extra, param in (({"min_p": 0.1}, "min_p"), ({"logit_bias": {"42": 1}}, "logit_bias")):
        resp = httpx.post(live.url + "/v1/completions", timeout=60,
                          json={"model": model, "prompt": "Hi", "max_tokens": 2, "stream": True, **extra})
        if backend.name == "native":
            assert resp.status_code == 200
        else:
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def _token_ids(client, model, **body) -> list[int]:
    resp = client.completions.create(model=model, prompt="Hello", temperature=0, extra_body={"return_token_ids": True,
                                     **body.pop("extra_body", {})}, **body)
    return resp.choices[0].model_dump()["token_ids"]


def test_logit_bias_and_repetition_penalty_steer_greedy_decoding(steer, model):
    """+100 on one token makes greedy decoding repeat it; repetition_penalty 1e4 divides its (positive)
    logit once it was generated, so the next token is another, as vLLM defines it."""
    token = 1234
    assert _token_ids(steer, model, max_tokens=5, logit_bias={str(token): 100}) == [token] * 5
    penalised = _token_ids(steer, model, max_tokens=5, logit_bias={str(token): 100},
                           extra_body={"repetition_penalty": 1e4, "ignore_eos": True})
    assert penalised[0] == token and penalised[1] != token


def test_min_tokens_holds_back_eos(steer, model, tokenizer):
    """EOS biased by +100 ends the request at once; min_tokens=4 holds it back for 4 tokens (vLLM
    counts the EOS token itself in the usage, the native engine does not)."""
    bias = {str(tokenizer.eos_token_id): 100}
    now = steer.completions.create(model=model, prompt="Hello", max_tokens=10, temperature=0, logit_bias=bias)
    assert now.choices[0].finish_reason == "stop" and now.usage.completion_tokens <= 1
    held = steer.completions.create(model=model, prompt="Hello", max_tokens=10, temperature=0, logit_bias=bias,
                                     extra_body={"min_tokens": 4})
    assert held.choices[0].finish_reason == "stop" and 4 <= held.usage.completion_tokens <= 5


def test_stop_token_ids_end_the_request(client, model):
    full = _token_ids(client, model, max_tokens=12, extra_body={"ignore_eos": True})
    i = next(i for i in range(2, len(full)) if full[i] not in full[:i])  # a token not seen before
    cut = client.completions.create(model=model, prompt="Hello", max_tokens=12, temperature=0,
                                    extra_body={"stop_token_ids": [full[i]], "return_token_ids": True,
                                                "ignore_eos": True})
    ids = cut.choices[0].model_dump()["token_ids"]
    assert cut.choices[0].finish_reason == "stop" and ids[:i] == full[:i] and len(ids) <= i + 1


def test_include_stop_str_in_output(client, model):
    full = client.completions.create(model=model, prompt="Hello", max_tokens=12, temperature=0).choices[0].text
    stop = full[4:8]
    cut = client.completions.create(model=model, prompt="Hello", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"include_stop_str_in_output": True})
    assert cut.choices[0].text == full[: full.index(stop) + len(stop)] and cut.choices[0].finish_reason == "stop"


def test_skip_special_tokens_false_shows_them(steer, model, tokenizer):
    """With ignore_eos and EOS forced, every token is EOS: hidden by default, shown as text with
    skip_special_tokens=false."""
    body = {"max_tokens": 3, "temperature": 0, "logit_bias": {str(tokenizer.eos_token_id): 100}}
    shown = steer.completions.create(model=model, prompt="Hello", **body,
                                     extra_body={"ignore_eos": True, "skip_special_tokens": False})
    hidden = steer.completions.create(model=model, prompt="Hello", **body, extra_body={"ignore_eos": True})
    assert shown.choices[0].text == tokenizer.eos_token * 3 and hidden.choices[0].text == ""


def test_echo_puts_the_prompt_before_the_text(client, model):
    plain = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0)
    echoed = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text
    chunks = list(client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text


def test_best_of_returns_the_n_most_likely_samples(client, model, backend):
    """best_of=4, n=2: two choices, best first by cumulative log-prob; usage counts all 4 samples.
    The native engine reproduces a seed whatever speculation does, so there the two are the best
    two of the same 4 samples asked for with n=4."""
    body = dict(model=model, prompt="Once upon a time", max_tokens=5, temperature=1.0, seed=11, logprobs=1,
                extra_body={"ignore_eos": True})
    best = client.completions.create(best_of=4, n=2, **body)
    cumulative = [sum(c.logprobs.token_logprobs) for c in best.choices]
    assert [c.index for c in best.choices] == [0, 1] and cumulative[0] >= cumulative[1]
    assert best.usage.completion_tokens == 20
    unranked = client.completions.create(model=model, prompt="Hi", max_tokens=3, best_of=3, temperature=1.0)
    assert len(unranked.choices) == 1 and unranked.choices[0].logprobs is None  # ranked by log-probs not asked for
    if backend.name == "native":
        four = client.completions.create(n=4, **body)
        ranked = sorted(four.choices, key=lambda c: -sum(c.logprobs.token_logprobs))[:2]
        assert [c.text for c in best.choices] == [c.text for c in ranked]


@pytest.mark.parametrize("body,param", [
    ({"echo": True, "logprobs": 1}, "echo"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"best_of": 9, "n": 1}, "best_of"),
    ({"prompt": [5, -1], "echo": True}, "prompt"),  # echo decoded the ids before they were checked: a 500 (issue 60)
    ({"prompt": [[5], []]}, "prompt"),
])
def test_bad_completion_requests_name_the_parameter(live, model, body, param):
    resp = httpx.post(live.url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 4, **body},
                      timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


@pytest.mark.parametrize("body,param", [
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 150}}, "logit_bias"),
    ({"stop_token_ids": [10 ** 9]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": ""}, "stop"),
])
def test_bad_sampling_parameters_get_400_naming_them(live, model, body, param):
    resp = httpx.post(live.url + "/v1/chat/completions", json={"model": model, "messages": MESSAGES, **body},
                      timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and param in error["message"] and error["type"] == "invalid_request_error"


# ---- vLLM's other routes ---------------------------------------------------------------------

def test_models_name_the_context_length(live, model):
    [entry] = httpx.get(live.url + "/v1/models").json()["data"]
    assert entry["id"] == model and entry["max_model_len"] > 0


def test_tokenize_and_detokenize_match_what_generation_reads(live, client, model):
    prompt = "The quick brown fox"
    tokens = httpx.post(live.url + "/tokenize", json={"model": model, "prompt": prompt}).json()
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=1, extra_body={"return_token_ids": True})
    assert tokens["tokens"] == resp.choices[0].model_dump()["prompt_token_ids"] and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == httpx.get(live.url + "/v1/models").json()["data"][0]["max_model_len"]
    assert httpx.post(live.url + "/detokenize", json={"model": model, "tokens": tokens["tokens"]}).json() == \
        {"prompt": prompt}
    chat = httpx.post(live.url + "/tokenize", json={"model": model, "messages": MESSAGES}).json()
    usage = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens


@pytest.mark.parametrize("route,body,status,param", [
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"messages": [], "add_generation_prompt": True}, 400, "messages"),  # the fuzzer's 500 (issue 60)
    ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    ("/tokenize", {"model": "gpt-4", "prompt": "hi"}, 404, None),
])
def test_bad_tokenizer_requests(live, route, body, status, param):
    resp = httpx.post(live.url + route, json=body)
    assert resp.status_code == status and resp.json()["error"]["param"] == param, resp.text


def test_a_conversation_the_chat_template_refuses_is_a_400_naming_messages(tokenizer):
    """The template's own `raise_exception` (many templates refuse an order of roles) is the caller's input."""
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('start with a user turn') }}" \
                           "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert _chat_prompt([ChatMessage(role="user", content="hi")], strict)
    with pytest.raises(InvalidRequestError, match="start with a user turn") as refused:
        _chat_prompt([ChatMessage(role="assistant", content="hi")], strict)
    assert refused.value.param == "messages"


def test_version_and_ping(live):
    version = httpx.get(live.url + "/version")
    assert version.status_code == 200 and isinstance(version.json()["version"], str)
    for method in ("GET", "POST"):
        ping = httpx.request(method, live.url + "/ping")
        assert ping.status_code == 200 and ping.text in ("", "{}")


# ---- the API key (the "bare" server has one) -----------------------------------------------

def test_api_key_guards_the_api_and_nothing_else(bare, backend):
    chat = {"model": backend.model, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    guarded = [("POST", "/v1/chat/completions", chat), ("GET", "/v1/models", None),
               ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]})]
    for method, route, body in guarded:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            resp = httpx.request(method, bare.url + route, json=body, headers=headers, timeout=60)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", (route, headers)
        assert httpx.request(method, bare.url + route, json=body, headers=API_HEADERS, timeout=60).status_code == 200
    resp = httpx.post(bare.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 401  # checked before the body is read
    for route in ("/health", "/ping", "/metrics", "/version"):
        assert httpx.get(bare.url + route).status_code == 200, route
    admin = httpx.get(bare.url + "/admin/weights", headers=API_HEADERS)  # the API key is no admin token
    assert admin.status_code == 403


def test_api_key_with_the_openai_client(bare, backend):
    good = openai.OpenAI(base_url=bare.url + "/v1", api_key=API_KEY, max_retries=0)
    assert good.chat.completions.create(model=backend.model, messages=MESSAGES, max_tokens=2).choices
    bad = openai.OpenAI(base_url=bare.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
