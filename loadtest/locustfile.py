"""Locust users for a live `specrl serve`: chat and text completions, streaming and not.

    SPECRL_LOADTEST_LOG=requests.jsonl locust -f loadtest/locustfile.py --headless -u 8 -r 4 -t 20s \
        --host http://127.0.0.1:8000 --csv out/locust --only-summary

Every response is checked (HTTP 200, a parseable body or SSE stream, a choice with a finish
reason, a `system_fingerprint` of the form `specrl:target=X;drafter=Y`); anything else marks
the request failed. Streaming requests also report two custom request types to the stats:

- TTFT: request sent -> first chunk with content;
- ITL: the gap between two consecutive content chunks (the server sends one chunk per engine
  step, and a speculative step may commit several tokens, so this is a per-step latency).

With SPECRL_LOADTEST_LOG set, each finished request appends one JSON line to that file
(one writer per locust process, flushed per line): id, kind, stream, start/end (wall clock,
seconds), status ("ok", the failure, or "interrupted" when locust stopped it), fingerprint
versions, the `specrl.versions` runs ([first output index, target, drafter] per choice), the
mean acceptance length, completion tokens, TTFT and ITL (ms), and for streams `seen`: when
each distinct fingerprint first appeared [wall, target, drafter].
This file imports nothing of specrl: locust runs it in its own process.
"""

from __future__ import annotations

import json
import os
import random
import re
import time

from locust import HttpUser, between, task

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "Name three primary colours.",
    "What is 12 times 7?",
    "Give me a synonym for happy.",
    "Describe a cat in one sentence.",
    "What does a compiler do?",
]
FINGERPRINT = re.compile(r"specrl:target=([^;]+);drafter=(.+)")
_log_file = None
_model: str | None = None


def log_request(entry: dict) -> None:
    """Append one JSON line to $SPECRL_LOADTEST_LOG (when set) and flush it."""
    global _log_file
    path = os.environ.get("SPECRL_LOADTEST_LOG")
    if not path:
        return
    if _log_file is None:
        _log_file = open(path, "a", buffering=1)
    _log_file.write(json.dumps(entry) + "\n")
    _log_file.flush()


class CheckFailed(Exception):
    """A response that is not what the API promises."""


def versions_of(fingerprint) -> tuple[str, str]:
    match = FINGERPRINT.fullmatch(fingerprint or "")
    if not match:
        raise CheckFailed(f"bad system_fingerprint {fingerprint!r}")
    return match.group(1), match.group(2)


def _spec_fields(data: dict, entry: dict) -> None:
    """The server's `specrl` extension (a body, or the usage chunk of a stream): version runs, acceptance length."""
    spec = data.get("specrl") or {}
    entry["versions"] = spec.get("versions")
    entry["acceptance_length"] = (spec.get("spec_decode") or {}).get("mean_acceptance_length")


class SpecrlUser(HttpUser):
    wait_time = between(0.05, 0.3)

    def on_start(self) -> None:
        global _model
        if _model is None:
            resp = self.client.get("/v1/models", name="/v1/models")
            _model = resp.json()["data"][0]["id"]

    @task(3)
    def chat_stream(self) -> None:
        self._call("chat", stream=True)

    @task(2)
    def chat(self) -> None:
        self._call("chat", stream=False)

    @task(2)
    def completion_stream(self) -> None:
        self._call("completion", stream=True)

    @task(1)
    def completion(self) -> None:
        self._call("completion", stream=False)

    # ---- one request ---------------------------------------------------------------------
    def _call(self, kind: str, stream: bool) -> None:
        prompt = random.choice(PROMPTS)
        body = {"model": _model, "max_tokens": random.randint(16, 32), "temperature": random.choice([0.0, 0.7])}
        if kind == "chat":
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
        else:
            path, body["prompt"] = "/v1/completions", prompt
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        name = f"{path}{' [stream]' if stream else ''}"
        entry = {"kind": kind, "stream": stream, "id": None, "pid": os.getpid(), "status": "interrupted",
                 "start": time.time()}
        started = time.perf_counter()
        with self.client.post(path, json=body, name=name, stream=stream, catch_response=True) as resp:
            try:
                entry["http_status"] = resp.status_code
                if resp.status_code != 200:
                    raise CheckFailed(f"HTTP {resp.status_code}: {resp.text[:300]}")
                if stream:
                    self._read_stream(resp, kind, started, entry)
                else:
                    self._read_body(resp.json(), kind, entry)
                entry["status"] = "ok"
                resp.success()
            except (CheckFailed, ValueError, KeyError, TypeError, IndexError, OSError) as exc:
                entry["status"] = f"{type(exc).__name__}: {exc}"
                resp.failure(entry["status"])
            finally:
                entry["end"] = time.time()
                resp.request_meta["response_time"] = (time.perf_counter() - started) * 1000
                log_request(entry)
        if stream and entry["status"] == "ok":
            fire = self.environment.events.request.fire
            if entry["ttft_ms"] is not None:
                fire(request_type="TTFT", name=name, response_time=entry["ttft_ms"], response_length=0,
                     exception=None, context={})
            for gap in entry["itl_ms"]:
                fire(request_type="ITL", name=name, response_time=gap, response_length=0, exception=None, context={})

    @staticmethod
    def _read_body(data: dict, kind: str, entry: dict) -> None:
        entry["id"] = data["id"]
        entry["fingerprint"] = data.get("system_fingerprint")
        entry["target"], entry["drafter"] = versions_of(entry["fingerprint"])
        [choice] = data["choices"]
        text = choice["message"]["content"] if kind == "chat" else choice["text"]
        if not isinstance(text, str) or choice["finish_reason"] not in ("stop", "length"):
            raise CheckFailed(f"bad choice {choice!r}")
        entry["completion_tokens"] = data["usage"]["completion_tokens"]
        _spec_fields(data, entry)

    @staticmethod
    def _read_stream(resp, kind: str, started: float, entry: dict) -> None:
        entry.update(ttft_ms=None, itl_ms=[], seen=[], versions=None)
        last = None
        finish = usage = None
        done = False
        for raw in resp.iter_lines():
            if not raw:
                continue
            line = raw.decode()
            if not line.startswith("data: "):
                raise CheckFailed(f"not an SSE data line: {line[:200]!r}")
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise CheckFailed(f"error in stream: {chunk['error']}")
            now, wall = time.perf_counter(), time.time()
            entry["id"] = entry["id"] or chunk["id"]
            if chunk["id"] != entry["id"]:
                raise CheckFailed(f"chunk id {chunk['id']} in stream {entry['id']}")
            versions = versions_of(chunk.get("system_fingerprint"))
            if not entry["seen"] or entry["seen"][-1][1:] != list(versions):
                entry["seen"].append([wall, *versions])
            entry["fingerprint"] = chunk["system_fingerprint"]
            if chunk.get("usage"):
                usage = chunk["usage"]
                _spec_fields(chunk, entry)
                continue
            [choice] = chunk["choices"]
            content = choice["delta"].get("content") if kind == "chat" else choice["text"]
            if content:
                if last is None:
                    entry["ttft_ms"] = (now - started) * 1000
                else:
                    entry["itl_ms"].append(round((now - last) * 1000, 3))
                last = now
            finish = choice.get("finish_reason") or finish
        if not done:
            raise CheckFailed("the stream ended without [DONE]")
        if finish not in ("stop", "length"):
            raise CheckFailed(f"the stream ended with finish_reason {finish!r}")
        if usage is None:
            raise CheckFailed("no usage chunk although stream_options.include_usage was set")
        entry["target"], entry["drafter"] = versions_of(entry["fingerprint"])
        entry["completion_tokens"] = usage["completion_tokens"]
