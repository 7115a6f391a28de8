"""The prefix-reuse workloads of `specrl bench serve`, run against one live server (the bench
starts it twice per backend: prefix cache on, and off with `--no-prefix-cache`):

- shared_prefix: chat requests one after another, each the same 1,000-token system prompt and a
  different user turn; TTFT per request (arrival to the first streamed token). Target: p50 with
  reuse <= 0.25x without.
- n8: completions with n = 8 of a prompt of the same length that no earlier request started
  with; the time from arrival to each choice's first token, and to the 8th's. Target: the 8th
  first token with reuse <= 0.3x without; the prompt prefilled once (the servers'
  `vllm:prefix_cache_hits` over the scenario: 7 of the 8 prompts).

A first token is the first streamed chunk of a choice that carries a token: every request asks
for log-probs, so each token has a chunk even when its text is empty (a special token, half a
UTF-8 character). One warm-up request per workload (its first sight of the system prompt) is not
counted. The servers' prefix counters (`vllm:prefix_cache_queries` / `_hits`, from /metrics) over
each workload are kept in its row.
"""

from __future__ import annotations

import json
import random
import time

import httpx

from specrl.apps.bench.backends import ratio
from specrl.loadtest.report import percentile

SYSTEM_TOKENS = 1000
N = 8
MAX_TOKENS = 8
TIMEOUT_S = 600.0
TARGETS = {"shared_prefix": 0.25, "n8": 0.3}  # with reuse over without, at most (issue 17)
WORDS = ("answer", "question", "carefully", "policy", "customer", "order", "refund", "shipping", "warranty", "account",
         "always", "never", "politely", "briefly", "explain", "product", "support", "invoice", "delivery", "review",
         "the", "a", "of", "to", "and", "when", "if", "with", "for", "your", "their", "each", "every", "rule")
TURNS = ("Where is my order?", "How do I reset my password?", "Can I return a gift?", "What is your warranty?",
         "My invoice is wrong.", "Do you ship abroad?", "How long does delivery take?", "Can I change my address?",
         "Is this product waterproof?", "How do I cancel?", "Why was I charged twice?", "Do you have a store nearby?")


def measure(url: str, model: str, requests: int, seed: int = 0) -> dict[str, dict]:
    """Both workloads against the server at `url`. -> {"shared_prefix": row, "n8": row}: TTFT and
    first-token percentiles (ms) and the server's prefix counters over each."""
    system = long_text(url, model, SYSTEM_TOKENS, random.Random(seed))
    return {"shared_prefix": _shared_prefix(url, model, system, requests),
            "n8": _n8(url, model, system, max(2, requests // 4))}


def long_text(url: str, model: str, tokens: int, gen: random.Random) -> str:
    """Text of exactly `tokens` tokens of the served model (its /tokenize, then /detokenize of the first `tokens`)."""
    rules = [f"Rule {i}: " + " ".join(gen.choice(WORDS) for _ in range(12)) + "." for i in range(tokens // 8)]
    ids = httpx.post(url + "/tokenize", json={"model": model, "prompt": " ".join(rules), "add_special_tokens": False},
                     timeout=60).json()["tokens"]
    if len(ids) < tokens:
        raise RuntimeError(f"{len(ids)} tokens of text, {tokens} needed")
    return httpx.post(url + "/detokenize", json={"model": model, "tokens": ids[:tokens]}, timeout=60).json()["prompt"]


def _shared_prefix(url: str, model: str, system: str, requests: int) -> dict:
    def body(turn: str) -> dict:
        return {"model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": turn}],
                "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": True}

    first_token_ms(url + "/v1/chat/completions", body("Hello."))  # warm-up: the system prompt's first prefill
    before = prefix_counters(url)
    ttft = [first_token_ms(url + "/v1/chat/completions", body(f"{TURNS[i % len(TURNS)]} (ticket {i})"))[0]
            for i in range(requests)]
    return {"requests": requests, "system_tokens": SYSTEM_TOKENS, "ttft_ms": _percentiles(ttft),
            **_since(before, prefix_counters(url))}


def _n8(url: str, model: str, system: str, trials: int) -> dict:
    def body(trial: int) -> dict:  # a new first word: no earlier prompt shares a prefix with it
        return {"model": model, "prompt": f"Document {trial} of the archive. {system}", "n": N,
                "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": trial, "ignore_eos": True, "stream": True,
                "logprobs": 0}

    first_token_ms(url + "/v1/completions", body(-1))  # warm-up (n = 8 paths, not the prompt)
    before = prefix_counters(url)
    firsts = [first_token_ms(url + "/v1/completions", body(trial)) for trial in range(trials)]
    return {"trials": trials, "n": N, "prompt_tokens_about": SYSTEM_TOKENS,
            "first_token_ms": _percentiles([min(f) for f in firsts]),
            "eighth_first_token_ms": _percentiles([max(f) for f in firsts]), **_since(before, prefix_counters(url))}


def first_token_ms(url: str, body: dict) -> list[float]:
    """Stream one request. -> per choice (by index) ms from sending it to that choice's first token."""
    firsts: dict[int, float] = {}
    started = time.perf_counter()
    with httpx.stream("POST", url, json=body, timeout=TIMEOUT_S) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: {resp.status_code} {resp.read().decode()[:300]}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            for choice in chunk.get("choices", []):
                if choice["index"] not in firsts and _has_token(choice):
                    firsts[choice["index"]] = (time.perf_counter() - started) * 1000
    if len(firsts) != body.get("n", 1):
        raise RuntimeError(f"{url}: {len(firsts)} of {body.get('n', 1)} choices streamed a token")
    return [firsts[i] for i in sorted(firsts)]


def _has_token(choice: dict) -> bool:
    """Whether a streamed choice chunk carries a token (text, or the log-probs every token has)."""
    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
    return bool(text) or bool(choice.get("logprobs"))


def prefix_counters(url: str) -> tuple[float, float]:
    """The server's (vllm:prefix_cache_queries, vllm:prefix_cache_hits) from /metrics (0 when absent)."""
    from specrl.apps.bench.serve import prometheus_value

    text = httpx.get(url + "/metrics", timeout=30).text
    return tuple(prometheus_value(text, f"vllm:prefix_cache_{name}_total") or 0.0 for name in ("queries", "hits"))


def _since(before: tuple[float, float], after: tuple[float, float]) -> dict:
    return {"prefix_cache_queries": after[0] - before[0], "prefix_cache_hits": after[1] - before[1]}


def _percentiles(values: list[float]) -> dict:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "values": values}


def reuse_ratios(rows: list[dict]) -> dict:
    """Per backend, with reuse over without: shared_prefix TTFT p50, n8 8th-first-token p50, each
    with the issue's target and whether it is met."""
    by = {(r["backend"], r["scenario"], r["prefix_cache"]): r for r in rows}
    out: dict = {}
    for backend in dict.fromkeys(r["backend"] for r in rows):
        for scenario, field in (("shared_prefix", "ttft_ms"), ("n8", "eighth_first_token_ms")):
            on, off = by.get((backend, scenario, True)), by.get((backend, scenario, False))
            value = ratio(on and on[field]["p50"], off and off[field]["p50"])
            out.setdefault(backend, {})[f"{field}_p50_{scenario}_reuse_over_none"] = {
                "ratio": value, "target": TARGETS[scenario], "met": value is not None and value <= TARGETS[scenario]}
    return out
