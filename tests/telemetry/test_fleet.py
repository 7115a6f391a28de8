"""FleetFeed against the real Redis server (127.0.0.1:6379): other replicas' finished requests
reach the suffix index, at most once; this replica's, unfinished ones, content-off ones and
broken records do not; Redis trouble does not stop it."""

import time
import uuid

import pytest
import redis

from specrl.speculation.suffix_index import SuffixIndex
from specrl.telemetry.fleet import FleetFeed
from specrl.telemetry.record import SegmentRecord, StepRecord
from specrl.telemetry.redis_sink import RECORD_FIELD, RedisSink, strip_content

REDIS_URL = "redis://127.0.0.1:6379/0"
PROMPT = [5, 6, 7, 8]
ANSWER = [11, 12, 13, 14, 15, 16, 17, 18]


@pytest.fixture
def stream():
    name = f"specrl-test-fleet-{uuid.uuid4().hex[:8]}:events"
    yield name
    redis.Redis.from_url(REDIS_URL).delete(name)


def segments(request_id: str, replica: str, tokens: list[int], per_segment: int = 3) -> list[SegmentRecord]:
    chunks = [tokens[i:i + per_segment] for i in range(0, len(tokens), per_segment)]
    return [SegmentRecord(request_id, i, "base", "day0", replica=replica, prompt_ids=PROMPT if i == 0 else None,
                          tokens=chunk, steps=[StepRecord(len(PROMPT), 0, [], [], 0, chunk[-1])],
                          finish_reason="stop" if i == len(chunks) - 1 else None) for i, chunk in enumerate(chunks)]


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def drafts(index: SuffixIndex) -> list[int]:
    return index.propose(index.new_request(PROMPT + ANSWER[:2]), 8, 0.1).tokens


@pytest.mark.redis
def test_other_replicas_requests_reach_the_index_once(stream):
    index = SuffixIndex(10_000)
    feed = FleetFeed(REDIS_URL, stream, "here", index).start()
    try:
        time.sleep(0.3)  # the feed reads what arrives after it starts
        sink = RedisSink(REDIS_URL, stream, batch=4)
        for record in segments("own-1", "here", ANSWER) + segments("open-1", "there", ANSWER)[:-1]:
            sink.emit(record)
        for record in segments("theirs-1", "there", ANSWER) * 2:  # delivered twice: added once
            sink.emit(record)
        sink.close(5.0)
        assert wait_for(lambda: feed.added == 1)
        time.sleep(0.3)
        assert feed.added == 1 and index.documents == 1 and index.duplicates == 1
        assert drafts(index) == ANSWER[2:]  # the other replica's answer now drafts here
    finally:
        feed.stop()


@pytest.mark.redis
def test_content_off_and_broken_records_are_skipped(stream):
    index = SuffixIndex(10_000)
    feed = FleetFeed(REDIS_URL, stream, "here", index).start()
    try:
        time.sleep(0.3)
        client = redis.Redis.from_url(REDIS_URL)
        client.xadd(stream, {RECORD_FIELD: b"not msgpack"})
        for record in segments("stripped", "there", ANSWER):
            client.xadd(stream, {RECORD_FIELD: strip_content(record).to_msgpack()})
        for record in segments("theirs-2", "there", ANSWER):
            client.xadd(stream, {RECORD_FIELD: record.to_msgpack()})
        assert wait_for(lambda: feed.added == 1)
        assert feed.skipped >= 2 and index.documents == 1
    finally:
        feed.stop()


def test_a_dead_redis_is_waited_out_without_raising():
    index = SuffixIndex(1000)
    feed = FleetFeed("redis://127.0.0.1:1/0", "nowhere", "here", index).start()
    assert wait_for(lambda: feed.errors >= 2)
    feed.stop()
    assert index.documents == 0


def test_out_of_order_segments_drop_the_request():
    index = SuffixIndex(1000)
    feed = FleetFeed(REDIS_URL, "unused", "here", index)
    first, second, third = segments("gap", "there", ANSWER)
    for record in (first, third):  # the middle segment was lost
        feed.take(record.to_msgpack())
    assert feed.added == 0 and feed.dropped == 1 and index.documents == 0
