"""Shutdown, saturation and Redis trouble, against live servers."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from specrl.telemetry import SegmentRecord
from tests.serving.conftest import REDIS_URL, start_server

CHAT = {"model": "tiny-random", "messages": [{"role": "user", "content": "Tell me a story."}], "temperature": 0}


@pytest.mark.redis
def test_sigterm_finishes_in_flight_requests_flushes_and_exits_zero(home, tmp_path, tiny_dir):
    srv = start_server(home, tmp_path, "--redis-url", REDIS_URL)
    chunks, finish = [], []

    def stream():
        body = {**CHAT, "max_tokens": 150, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    data = json.loads(line[6:])
                    chunks.append(data)
                    finish.extend(c["finish_reason"] for c in data["choices"] if c["finish_reason"])

    worker = threading.Thread(target=stream)
    worker.start()
    while not chunks:
        time.sleep(0.01)
    rc = srv.stop()  # SIGTERM while the request is streaming
    worker.join(timeout=60)
    assert rc == 0, srv.log.read_text()
    assert finish == ["length"]
    records = [SegmentRecord.from_msgpack(f[b"r"]) for _, f in redis.Redis.from_url(REDIS_URL).xrange(srv.stream)]
    redis.Redis.from_url(REDIS_URL).delete(srv.stream)
    assert records and records[-1].finish_reason == "length"  # telemetry flushed before exit


def test_saturated_server_answers_429_with_retry_after(home, tmp_path, tiny_dir):
    srv = start_server(home, tmp_path, "--max-batch", "1", env={"SPECRL_MAX_WAITING": "1"})
    try:
        def call(_):
            return httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 60}, timeout=120)

        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(call, range(8)))
        codes = sorted(r.status_code for r in responses)
        assert set(codes) == {200, 429} and codes.count(200) >= 2
        refused = [r for r in responses if r.status_code == 429][0]
        assert refused.headers["retry-after"] == "1" and refused.json()["error"]["type"] == "rate_limit_error"
    finally:
        srv.stop()


def test_redis_down_never_fails_a_request(home, tmp_path, tiny_dir):
    srv = start_server(home, tmp_path, "--redis-url", "redis://127.0.0.1:1/0")
    try:
        for _ in range(3):
            assert httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 8}).status_code == 200
        metrics = {line.split()[0]: float(line.split()[-1]) for line in httpx.get(srv.url + "/metrics").text.splitlines()
                   if line.startswith("specrl_telemetry")}
        assert metrics["specrl_telemetry_records_sent_total"] == 0
        # held in the bounded queue while Redis is away, or dropped and counted: never lost silently
        assert metrics["specrl_telemetry_records_queued"] + metrics["specrl_telemetry_records_dropped_total"] == 3
    finally:
        assert srv.stop() == 0
