"""RedisSink against the real Redis server (127.0.0.1:6379), a dead port, and a throwaway
redis-server started by the test. Every key lives under a per-test prefix, deleted after."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid

import pytest
import redis

from specrl.telemetry.reader import RecordReader
from specrl.telemetry.record import SegmentRecord, StepRecord
from specrl.telemetry.redis_sink import RECORD_FIELD, RedisSink, events_stream, strip_content

REDIS_URL = "redis://127.0.0.1:6379/0"
DEAD_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1: connection refused


def make_record(i: int) -> SegmentRecord:
    return SegmentRecord(
        request_id=f"req-{i}", segment=i % 3, target_version="t1", drafter_version="d7",
        prompt_ids=[1, 2, 3, i], tokens=[10 + i, 11, 12, 13, 14],
        steps=[StepRecord(position=4, k=3, draft_tokens=[10 + i, 11, 99],
                          draft_logprobs=[-0.1, -0.5, -2.0], accepted=2, target_token=12),
               StepRecord(position=7, k=0, draft_tokens=[], draft_logprobs=[], accepted=0, target_token=13),
               StepRecord(position=8, k=1, draft_tokens=[14], draft_logprobs=[-0.25], accepted=1, target_token=15)],
        finish_reason="stop" if i % 2 else None)


def wait_for(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def read_all(url: str, stream: str, expected: int) -> list[SegmentRecord]:
    reader = RecordReader(url, stream, "check", "c0")
    reader.ensure_group()
    out: list[SegmentRecord] = []
    while len(out) < expected:
        batch = reader.read(count=100)
        if not batch:
            break
        out += [record for _, record in batch]
    reader.close()
    return out


@pytest.fixture
def prefix():
    p = f"specrl-test:{uuid.uuid4().hex}:"
    yield p
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=p + "*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def client():
    c = redis.Redis.from_url(REDIS_URL)
    yield c
    c.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_events_stream_key_carries_the_deployments_hash_tag():
    assert events_stream("prod-a") == "{specrl:prod-a}:events"  # one Redis Cluster slot per deployment


def test_strip_content_keeps_ids_versions_and_counters():
    record = make_record(5)
    stripped = strip_content(record)
    assert (stripped.request_id, stripped.segment, stripped.target_version, stripped.drafter_version,
            stripped.finish_reason) == ("req-5", 2, "t1", "d7", "stop")
    assert stripped.prompt_ids is None and stripped.tokens == []
    assert [(s.position, s.k, s.accepted) for s in stripped.steps] == [(4, 3, 2), (7, 0, 0), (8, 1, 1)]
    assert all(s.draft_tokens == [] and s.draft_logprobs == [] and s.target_token == -1 for s in stripped.steps)
    assert stripped.spec_counts() == record.spec_counts()
    assert record.tokens == [15, 11, 12, 13, 14]  # the original is untouched


@pytest.mark.redis
def test_round_trip_through_the_stream(prefix, client):
    stream = prefix + "events"
    records = [make_record(i) for i in range(50)]
    sink = RedisSink(REDIS_URL, stream, batch=8)
    for record in records:
        sink.emit(record)
    sink.close(timeout=10)
    assert (sink.emitted, sink.sent, sink.dropped, sink.queued) == (50, 50, 0, 0)
    assert client.xlen(stream) == 50
    _, fields = client.xrange(stream, count=1)[0]
    assert set(fields) == {RECORD_FIELD.encode()}
    assert read_all(REDIS_URL, stream, 50) == records


@pytest.mark.redis
def test_maxlen_bounds_the_stream_approximately(prefix, client):
    stream = prefix + "events"
    sink = RedisSink(REDIS_URL, stream, maxlen=100, batch=50)
    for i in range(2000):
        sink.emit(make_record(i))
    sink.close(timeout=10)
    assert sink.sent == 2000
    # MAXLEN ~ trims whole macro nodes: at least maxlen stay, less than one node more.
    node = int(client.config_get("stream-node-max-entries")["stream-node-max-entries"])
    assert 100 <= client.xlen(stream) < 100 + max(node, 1) + 1


def test_full_queue_drops_and_emit_never_blocks():
    sink = RedisSink(DEAD_URL, "specrl-test:unused", queue_size=100)
    for i in range(100_000):
        sink.emit(make_record(i % 10))  # returns at once: Redis is unreachable, the queue full
    assert sink.emitted == 100_000
    assert sink.dropped >= 100_000 - 100 and sink.queued <= 100
    assert sink.sent == 0 and not sink.connected
    sink.close(timeout=1)
    assert sink.dropped == 100_000 and sink.queued == 0  # the backlog is counted at close
    assert sink.errors >= 1
    sink.emit(make_record(0))  # after close: dropped, no error
    assert sink.dropped == 100_001


@pytest.mark.redis
def test_content_off_sends_counters_only(prefix):
    stream = prefix + "events"
    records = [make_record(i) for i in range(3)]
    sink = RedisSink(REDIS_URL, stream, content=False)
    for record in records:
        sink.emit(record)
    sink.close(timeout=10)
    got = read_all(REDIS_URL, stream, 3)
    assert got == [strip_content(r) for r in records]
    assert all(r.prompt_ids is None and r.tokens == [] for r in got)
    assert [r.spec_counts() for r in got] == [r.spec_counts() for r in records]


@pytest.mark.redis
def test_unencodable_record_is_dropped_and_the_sender_goes_on(prefix):
    stream = prefix + "events"
    bad = make_record(1)
    bad.tokens = [object()]  # msgpack cannot encode this
    sink = RedisSink(REDIS_URL, stream)
    for record in (make_record(0), bad, make_record(2)):
        sink.emit(record)
    sink.close(timeout=10)
    assert (sink.sent, sink.dropped, sink.errors) == (2, 1, 1)
    assert [r.request_id for r in read_all(REDIS_URL, stream, 2)] == ["req-0", "req-2"]


@pytest.fixture
def throwaway_port(tmp_path):
    """A free port and a function that starts redis-server on it (stopped at teardown)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH")
    port = free_port()
    servers: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        servers.append(proc)
        return proc

    yield port, start
    for proc in servers:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.mark.redis
def test_records_flow_after_redis_comes_up_and_outage_is_counted(throwaway_port):
    port, start_server = throwaway_port
    url = f"redis://127.0.0.1:{port}/0"
    stream = "specrl-test:events"  # the throwaway server is ours alone
    sink = RedisSink(url, stream, queue_size=1000)
    try:
        first = [make_record(i) for i in range(5)]
        for record in first:
            sink.emit(record)
        assert wait_for(lambda: sink.errors >= 1)  # a connect attempt failed
        assert sink.sent == 0 and not sink.connected

        server = start_server()
        assert wait_for(lambda: sink.sent == 5), (sink.sent, sink.dropped, sink.errors)
        assert sink.connected
        second = [make_record(i) for i in range(5, 10)]
        for record in second:
            sink.emit(record)
        assert wait_for(lambda: sink.sent == 10)
        assert read_all(url, stream, 10) == first + second

        server.terminate()
        server.wait(timeout=5)
        errors = sink.errors
        for i in range(20):
            sink.emit(make_record(i))  # never raises while Redis is gone
        assert wait_for(lambda: sink.errors > errors and not sink.connected)
    finally:
        sink.close(timeout=1)
    assert sink.emitted == sink.sent + sink.dropped == 30


@pytest.mark.redis
def test_records_redis_accepted_then_lost_in_a_restart_are_counted(throwaway_port):
    """A Redis without persistence comes back empty: the sink finds the records it had sent
    missing (`lost`), and counts the batch that failed against the dead server as dropped."""
    port, start_server = throwaway_port
    url = f"redis://127.0.0.1:{port}/0"
    stream = "specrl-test:events"
    server = start_server()
    sink = RedisSink(url, stream)
    try:
        assert wait_for(lambda: sink.connected)
        for i in range(12):
            sink.emit(make_record(i))
        assert wait_for(lambda: sink.sent == 12)
        server.kill()  # a crash: nothing it held survives
        server.wait(timeout=5)
        start_server()
        late = make_record(99)
        sink.emit(late)  # its send fails on the dead connection, then the sink reconnects and checks
        assert wait_for(lambda: sink.lost == 12), (sink.lost, sink.sent, sink.dropped)
        assert sink.dropped == 1 and sink.dropped_tokens == len(late.prompt_ids) + len(late.tokens)
        sink.emit(make_record(100))
        assert wait_for(lambda: sink.sent == 13)
    finally:
        sink.close(timeout=1)
    assert sink.lost == 12  # counted once


@pytest.mark.redis
def test_the_embedded_valkey_keeps_the_stream_through_a_crash(tmp_path):
    """`specrl up`'s Redis (append-only file, fsync every second): killed with SIGKILL and restarted,
    it still has every record the sink had sent, consumer group included; the sink counts none lost."""
    import os
    import signal

    from specrl.apps.redis_server import RedisServer

    redis_server = RedisServer("", data_dir=tmp_path / "redis")
    stream = "specrl-test:events"
    sink = RedisSink(redis_server.url, stream)
    try:
        reader = RecordReader(redis_server.url, stream, "drafter", "t0")
        reader.ensure_group()
        for i in range(20):
            sink.emit(make_record(i))
        assert wait_for(lambda: sink.sent == 20)
        assert len(reader.read(count=5)) == 5  # delivered, not acked: pending
        os.kill(redis_server.server.pid, signal.SIGKILL)
        assert redis_server.restart_if_dead() and not redis_server.restart_if_dead()
        sink.emit(make_record(20))  # fails on the dead connection (dropped), then the sink reconnects
        sink.emit(make_record(21))
        assert wait_for(lambda: sink.sent == 21 or sink.sent + sink.dropped == 22)
        client = redis.Redis.from_url(redis_server.url)
        assert client.xlen(stream) == sink.sent and sink.lost == 0
        # The group keeps what it delivered, or, where the crash came before Valkey wrote the read to
        # its append-only file (everysec postpones that write up to 2 s while a background fsync runs:
        # a loaded CI machine), the read went back whole: nothing pending and the group's position
        # before the 5, which it delivers again. Either way no record is lost to the group.
        ids = [_stream_id(entry_id) for entry_id, _ in client.xrange(stream, count=5)]
        group = client.xinfo_groups(stream)[0]
        last = _stream_id(group["last-delivered-id"])
        assert (group["pending"], last) == (5, ids[-1]) or (group["pending"] == 0 and last < ids[0])
        client.close()
        reader.close()
    finally:
        sink.close(timeout=1)
        redis_server.stop()


def _stream_id(entry_id) -> tuple[int, int]:
    """A stream entry id (b"ms-seq") as a tuple that orders as the stream does."""
    ms, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")
    return int(ms), int(seq)
