"""A deployment on a real Redis Cluster of 3 masters (`redis-server --cluster-enabled yes` on three loopback
ports, joined by `redis-cli --cluster create`, started and stopped here): `connect` picks redis-py's RedisCluster,
every key of a deployment hashes to one slot, records go from RedisSink to RecordReader and are acked, a record
delivered again (a claim after a consumer died, as after a failover) is deduped by (request, segment), and the
deployment's `current` is announced and awaited across the cluster."""

from __future__ import annotations

import shutil
import uuid

import pytest
import redis
from redis.cluster import RedisCluster, key_slot

from specrl.redis_conn import connect
from specrl.telemetry import events_stream
from specrl.telemetry.reader import DEAD_LETTER_SUFFIX, RecordReader
from specrl.telemetry.redis_sink import RedisSink
from specrl.trainer.contexts import ContextBook
from specrl.weights import WeightsStore
from specrl.weights.deployment import DeploymentVersions, control_stream, current_key
from tests.redis_cluster import start_cluster, wait_until
from tests.telemetry.test_reader import make_record

pytestmark = [pytest.mark.redis,
              pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
                                 reason="needs redis-server and redis-cli")]


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory):
    cluster = start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster.url
    cluster.stop()


def test_connect_picks_the_cluster_client_and_a_deployment_keeps_to_one_slot(cluster_url):
    from tests.backends import REDIS_URL

    assert isinstance(connect(cluster_url), RedisCluster)
    assert not isinstance(connect(REDIS_URL), RedisCluster)  # the session's single server
    deployment = "fleet-a"
    keys = [events_stream(deployment), events_stream(deployment) + DEAD_LETTER_SUFFIX, current_key(deployment),
            control_stream(deployment)]
    assert len({key_slot(k.encode()) for k in keys}) == 1
    slots = {key_slot(events_stream(f"fleet-{i}").encode()) for i in range(16)}
    assert len(slots) > 1  # deployments spread over the cluster


def test_records_flow_are_acked_and_a_redelivery_is_deduped(cluster_url):
    deployment = f"cluster-{uuid.uuid4().hex[:8]}"
    stream = events_stream(deployment)
    sink = RedisSink(cluster_url, stream)
    records = [make_record(i) for i in range(20)]
    for record in records:
        sink.emit(record)
    sink.close()
    assert sink.sent == 20 and sink.dropped == 0
    first = RecordReader(cluster_url, stream, "drafter", "trainer-1")
    first.ensure_group()
    got = first.read(count=50)
    assert sorted(record.request_id for _, record in got) == sorted(r.request_id for r in records)
    assert first.ack([entry_id for entry_id, _ in got[:15]]) == 15  # trainer-1 dies holding 5 unacked
    second = RecordReader(cluster_url, stream, "drafter", "trainer-2")
    claimed = second.claim_stale(min_idle_ms=0)
    assert len(claimed) == 5
    # the trainer's dedupe (by request, segment: kept in its checkpoint) makes each record train once
    book = ContextBook()
    assert all(book.add(record) is not None for _, record in got)
    assert [book.add(record) for _, record in claimed] == [None] * 5
    assert second.ack([entry_id for entry_id, _ in claimed]) == 5 and second.lag() == 0
    connect(cluster_url).delete(stream)


def test_current_is_announced_and_awaited_on_the_cluster(cluster_url, tmp_path):
    deployment = f"cluster-{uuid.uuid4().hex[:8]}"
    store = WeightsStore(tmp_path / "store")
    source = tmp_path / "ckpt"
    source.mkdir()
    (source / "weights.safetensors").write_bytes(b"\x01" * 64)
    version = store.publish("drafter", source).version
    writer, watcher = DeploymentVersions(store, cluster_url, deployment), DeploymentVersions(
        WeightsStore(tmp_path / "empty"), cluster_url, deployment, wait_s=5.0)
    cursor = watcher.cursor()
    writer.set("drafter", version, "drain")
    assert watcher.wait(cursor) != cursor and watcher.get() == {"drafter": (version, "drain")}
    assert writer.redis_errors == watcher.redis_errors == 0
    writer.clear()


def test_a_master_lost_without_a_replica_drops_and_counts_and_the_sink_carries_on(tmp_path):
    """The master holding the stream dies with no replica to promote: batches fail (dropped, counted), the sender
    thread lives on; the node restarts empty with its slots, and the sink finds it, counts the records Redis took
    and then lost, and sends again."""
    cluster = start_cluster(tmp_path / "redis", masters=3)
    stream = events_stream(f"cluster-{uuid.uuid4().hex[:8]}")
    sink = RedisSink(cluster.url, stream)
    try:
        for i in range(10):
            sink.emit(make_record(i))
        wait_until(lambda: sink.sent == 10, what="the first records")
        master = cluster.master_of(stream)
        cluster.kill(master)
        for i in range(10, 20):
            sink.emit(make_record(i))
        wait_until(lambda: sink.dropped > 0, what="a failed send")
        assert sink._thread.is_alive() and not sink.connected
        cluster.restart(master)
        wait_until(lambda: redis.Redis(port=master).cluster("info")["cluster_state"] == "ok", what="the node back")
        for i in range(20, 30):
            sink.emit(make_record(i))
        wait_until(lambda: sink.queued == 0 and sink.sent + sink.dropped == 30 and sink.lost > 0,
                   what="records after the restart, and the loss counted")
        assert sink.lost == 10  # the first ten were sent, then gone with the node's memory
        assert sink.emitted == 30 and sink.sent > 10
        assert connect(cluster.url).xlen(stream) == sink.sent - sink.lost
    finally:
        sink.close()
        cluster.stop()
