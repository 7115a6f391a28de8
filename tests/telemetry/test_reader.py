"""RecordReader against the real Redis server (127.0.0.1:6379): pending re-reads, poison
entries, XAUTOCLAIM, lag. Every key lives under a per-test prefix, deleted after."""

from __future__ import annotations

import time
import uuid

import msgpack
import pytest
import redis

from specrl.telemetry.reader import RecordReader
from specrl.telemetry.record import SegmentRecord, StepRecord
from specrl.telemetry.redis_sink import RECORD_FIELD

pytestmark = pytest.mark.redis

REDIS_URL = "redis://127.0.0.1:6379/0"
GROUP = "drafter"


def make_record(i: int) -> SegmentRecord:
    return SegmentRecord(
        request_id=f"req-{i}", segment=0, target_version="t1", drafter_version="d1",
        prompt_ids=[1, 2, i], tokens=[7, 8],
        steps=[StepRecord(position=3, k=2, draft_tokens=[7, 9], draft_logprobs=[-0.2, -1.5],
                          accepted=1, target_token=8)])


@pytest.fixture
def client():
    c = redis.Redis.from_url(REDIS_URL)
    yield c
    c.close()


@pytest.fixture
def stream(client):
    prefix = f"specrl-test:{uuid.uuid4().hex}:"
    yield prefix + "events"
    keys = list(client.scan_iter(match=prefix + "*"))
    if keys:
        client.delete(*keys)


@pytest.fixture
def readers(stream):
    """Makes readers on `stream` (group `drafter`) and closes them at teardown."""
    made: list[RecordReader] = []

    def make(consumer: str, **kwargs) -> RecordReader:
        reader = RecordReader(REDIS_URL, stream, GROUP, consumer, **kwargs)
        reader.ensure_group()
        made.append(reader)
        return reader

    yield make
    for reader in made:
        reader.close()


def add(client, stream: str, records: list[SegmentRecord]) -> list[str]:
    return [client.xadd(stream, {RECORD_FIELD: r.to_msgpack()}).decode() for r in records]


def test_ensure_group_creates_the_stream_and_is_idempotent(client, stream, readers):
    reader = readers("c0")
    reader.ensure_group()
    assert client.exists(stream)
    assert reader.read(count=10) == [] and reader.lag() == 0


def test_pending_entries_come_back_first_after_a_crash(client, stream, readers):
    records = [make_record(i) for i in range(5)]
    ids = add(client, stream, records)
    first = readers("trainer-0").read(count=10)  # then "crash": no ack
    assert first == list(zip(ids, records))

    later = add(client, stream, [make_record(5)])
    restarted = readers("trainer-0")  # same consumer name, fresh process
    pages = [restarted.read(count=2) for _ in range(3)]  # pending, paged without acks
    assert [e for page in pages for e in page] == first
    assert restarted.read(count=10) == [(later[0], make_record(5))]  # then new entries

    assert restarted.ack(ids + later) == 6
    assert client.xpending(stream, GROUP)["pending"] == 0
    assert readers("trainer-0").read(count=10) == []


def test_poison_entries_go_to_the_dead_letter_stream_and_are_acked(client, stream, readers):
    good = add(client, stream, [make_record(0)])[0]
    garbage = client.xadd(stream, {RECORD_FIELD: b"\xc1\xff not msgpack"}).decode()
    no_field = client.xadd(stream, {"x": b"1"}).decode()
    other_schema = client.xadd(stream, {RECORD_FIELD: msgpack.packb({"schema": 99})}).decode()
    missing_key = client.xadd(stream, {RECORD_FIELD: msgpack.packb({"schema": 1})}).decode()
    dead = stream + ":dead-letters"
    reader = readers("c0", dead_letter_stream=dead)

    assert reader.read(count=10) == [(good, make_record(0))]
    assert reader.dead_lettered == 4
    letters = {f[b"id"].decode(): f for _, f in client.xrange(dead)}
    assert set(letters) == {garbage, no_field, other_schema, missing_key}
    assert letters[garbage][RECORD_FIELD.encode()] == b"\xc1\xff not msgpack"
    assert letters[no_field][RECORD_FIELD.encode()] == b""
    assert b"schema 99" in letters[other_schema][b"reason"]
    assert all(f[b"reason"] and f[b"stream"] == stream.encode() for f in letters.values())
    pending = client.xpending_range(stream, GROUP, min="-", max="+", count=10)
    assert [p["message_id"].decode() for p in pending] == [good]  # poison was acked


def test_default_dead_letter_stream_name(stream, readers):
    assert readers("c0").dead_letter_stream == stream + ":dead"


def test_pending_entry_trimmed_from_the_stream_is_acked_and_skipped(client, stream, readers):
    ids = add(client, stream, [make_record(i) for i in range(3)])
    readers("c0").read(count=10)
    client.xdel(stream, ids[1])
    restarted = readers("c0")
    assert [i for i, _ in restarted.read(count=10)] == [ids[0], ids[2]]
    assert restarted.trimmed == 1
    assert client.xpending(stream, GROUP)["pending"] == 2


def test_claim_stale_takes_over_a_dead_consumers_entries(client, stream, readers):
    records = [make_record(i) for i in range(3)]
    ids = add(client, stream, records)
    assert len(readers("dead").read(count=10)) == 3  # then it dies, never acking
    alive = readers("alive")
    assert alive.claim_stale(min_idle_ms=60_000) == []  # not idle long enough yet
    time.sleep(0.05)
    assert alive.claim_stale(min_idle_ms=20) == list(zip(ids, records))
    owners = client.xpending_range(stream, GROUP, min="-", max="+", count=10)
    assert {p["consumer"] for p in owners} == {b"alive"}
    assert alive.ack(ids) == 3


def test_claim_stale_respects_count(client, stream, readers):
    add(client, stream, [make_record(i) for i in range(5)])
    readers("dead").read(count=10)
    time.sleep(0.3)
    alive = readers("alive")
    assert len(alive.claim_stale(min_idle_ms=250, count=2)) == 2
    assert len(alive.claim_stale(min_idle_ms=250, count=10)) == 3  # the 2 claimed are fresh again


def test_lag_counts_undelivered_entries(client, stream, readers):
    add(client, stream, [make_record(i) for i in range(10)])
    reader = readers("c0")
    assert reader.lag() == 10
    got = reader.read(count=4)
    assert reader.lag() == 6
    reader.ack([i for i, _ in got])
    assert reader.lag() == 6
