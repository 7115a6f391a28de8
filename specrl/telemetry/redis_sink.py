"""The Redis sink: segment records go to a Redis stream, off the decode path.

`RedisSink.emit` only does `put_nowait` on a bounded in-process queue; a background daemon
thread drains the queue in batches into one pipelined round trip of
`XADD <stream> MAXLEN ~ <maxlen> * r <msgpack>` per batch. When the queue is full the record
is dropped and counted: the decode path never waits on Redis.

Stream layout (what `specrl.telemetry.reader.RecordReader` reads):
- key `{specrl:<deployment>}:events` (`events_stream`);
- one entry per record with one field, `r` (`RECORD_FIELD`): `SegmentRecord.to_msgpack()`.

Redis down or slow: the sender stops taking records while it has no connection and retries
with exponential backoff (0.1 s doubling up to 5 s); meanwhile the queue fills and further
records are dropped. A batch whose XADD pipeline fails (connection lost, socket timeout) is
dropped and counted, never retried, so memory stays bounded by `queue_size` + `batch`.
Accounting: `emitted == sent + dropped + queued + (records in the batch being sent)`.

Redis restarts: the sender keeps the ids of the records it sent in the last LOSS_WINDOW_S. When
it reconnects after a failure it looks those ids up (again before each send until the lookup answers: a
cluster node may take traffic before the stream's node is back); the ones Redis no longer has were handed to
Redis and lost with it (`lost`: a Redis without persistence loses everything, one with an
append-only file fsynced every second at most the last second or so). A lost record a trainer
had already read was trained on all the same: `lost` is an upper bound on the records no trainer saw.

Content off (`content=False`): `strip_content` reduces each record to counters (see there); the
sink then takes no features (`features_max_bytes` 0) either.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque

from redis.backoff import NoBackoff
from redis.retry import Retry

from specrl.redis_conn import REDIS_ERRORS, connect, deployment_key, drop_connections
from specrl.telemetry.record import SegmentRecord, StepRecord
from specrl.telemetry.sink import record_tokens

log = logging.getLogger(__name__)

RECORD_FIELD = "r"  # the stream entry's one field: the msgpack-encoded SegmentRecord
STRIPPED_TOKEN = -1  # stands for a token id that `strip_content` removed


def events_stream(deployment: str) -> str:
    """The stream key every replica of `deployment` appends its records to: `{specrl:<deployment>}:events`."""
    return deployment_key(deployment, "events")


def strip_content(record: SegmentRecord) -> SegmentRecord:
    """A copy of `record` without content: only ids, versions and counters remain.

    Kept: request_id, segment, versions, deployment, replica, finish_reason, schema, and per
    step position, k, accepted and proposer (so `spec_counts()` is unchanged). Emptied:
    prompt_ids -> None, tokens -> [], per step draft_tokens -> [], draft_logprobs -> [],
    target_token -> STRIPPED_TOKEN (-1), features -> None (feature_start 0, feature_dim 0,
    feature_dtype ""). A field added to the record that holds token ids, text, log-probs or
    features must be emptied here too.
    """
    steps = [
        StepRecord(position=s.position, k=s.k, draft_tokens=[], draft_logprobs=[],
                   accepted=s.accepted, target_token=STRIPPED_TOKEN, proposer=s.proposer)
        for s in record.steps
    ]
    return dataclasses.replace(record, prompt_ids=None, tokens=[], steps=steps, features=None, feature_start=0,
                               feature_dim=0, feature_dtype="")


class RedisSink:
    """A `RecordSink` that appends records to a Redis stream from a background thread.

    Counters (read them from any thread): `emitted`, `sent`, `dropped` (queue full, failed
    batch, or left over at close), `dropped_tokens` (their prompt and committed tokens), `lost`
    (sent, then gone after a Redis restart), `errors` (failed connects and failed batches),
    `queued` (records waiting now), `connected` (the last Redis call succeeded).

    features_max_bytes: the per-record budget of target features the engine may record (0: none;
    always 0 with content off).

    The sink keeps a reference to each emitted record until it is encoded on the sender
    thread: do not mutate a record after `emit`.
    """

    BACKOFF_MIN_S = 0.1
    BACKOFF_MAX_S = 5.0
    SOCKET_TIMEOUT_S = 2.0  # a Redis slower than this fails the batch (dropped, reconnect)
    POLL_S = 0.05  # how often an idle sender looks at its stop flag
    LOSS_WINDOW_S = 5.0  # sent ids kept to check after a reconnect (an AOF fsynced every second loses ~1 s)

    def __init__(self, url: str, stream: str, *, maxlen: int = 100_000,
                 queue_size: int = 10_000, batch: int = 256, content: bool = True, features_max_bytes: int = 0):
        self.url = url
        self.stream = stream
        self.maxlen = maxlen
        self.batch = batch
        self.content = content
        self.features_max_bytes = features_max_bytes if content else 0
        self.emitted = 0
        self.sent = 0
        self.lost = 0
        self.errors = 0
        self.connected = False
        self._dropped_on_emit = 0  # written under _lock (emit may run on several threads)
        self._dropped_on_send = 0  # written by the sender thread only
        self._dropped_tokens_on_emit = 0
        self._dropped_tokens_on_send = 0
        self._recent: deque[tuple[float, str]] = deque()  # (monotonic time sent, entry id), the last LOSS_WINDOW_S
        self._failed_at: float | None = None  # when the connection was lost (None: never lost since the check)
        self._lock = threading.Lock()
        self._queue: queue.Queue[SegmentRecord] = queue.Queue(maxsize=queue_size)
        # Built here so a malformed URL fails at construction; it connects lazily. No retries, on a cluster either: a
        # batch retried on a promoted replica would hide the failover, and with it the records the old master took.
        self._client = connect(url, socket_timeout=self.SOCKET_TIMEOUT_S,
                               socket_connect_timeout=self.SOCKET_TIMEOUT_S, retry=Retry(NoBackoff(), 0))
        self._closing = threading.Event()
        self._outage_logged = False
        self._deadline = float("inf")  # monotonic time after which close stops flushing
        self._thread = threading.Thread(target=self._run, name=f"redis-sink:{stream}", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        return self._dropped_on_emit + self._dropped_on_send

    @property
    def dropped_tokens(self) -> int:
        return self._dropped_tokens_on_emit + self._dropped_tokens_on_send

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def emit(self, record: SegmentRecord) -> None:
        """Queue `record` for sending; drop and count it when the queue is full or the sink
        is closed. Never blocks on Redis, never raises."""
        with self._lock:
            self.emitted += 1
            if self._closing.is_set():
                self._dropped_on_emit += 1
                self._dropped_tokens_on_emit += record_tokens(record)
                return
            try:
                self._queue.put_nowait(record)
            except queue.Full:
                self._dropped_on_emit += 1
                self._dropped_tokens_on_emit += record_tokens(record)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (best effort, within `timeout` seconds), then stop the sender.
        Records still queued when it stops are counted as dropped."""
        with self._lock:
            self._deadline = time.monotonic() + timeout
            self._closing.set()
        # One socket timeout of margin: a send in flight at the deadline finishes or fails.
        self._thread.join(timeout + self.SOCKET_TIMEOUT_S)

    # -- sender thread -------------------------------------------------------------------

    def _run(self) -> None:
        backoff = self.BACKOFF_MIN_S
        while not self._finished():
            if not self.connected and not self._connect():
                if self._closing.is_set():
                    break  # closing while Redis is down: nothing more can be sent
                self._closing.wait(backoff)  # close() cuts the wait short
                backoff = min(2 * backoff, self.BACKOFF_MAX_S)
                continue
            backoff = self.BACKOFF_MIN_S
            if self._failed_at is not None:
                self._count_lost()  # its check at the reconnect failed (a cluster whose node for the stream is not back)
            records = self._take()
            if records:
                self._send(records)
        self._drop_queued()
        self._client.close()
        self.connected = False

    def _finished(self) -> bool:
        if not self._closing.is_set():
            return False
        return self._queue.empty() or time.monotonic() >= self._deadline

    def _connect(self) -> bool:
        try:
            self._client.ping()
        except REDIS_ERRORS as exc:
            self._failed("connect", exc)
            return False
        self.connected = True
        self._outage_logged = False
        log.info("event=redis_sink_connected stream=%s url=%s", self.stream, _safe_url(self.url))
        if self._failed_at is not None:
            self._count_lost()
        return True

    def _count_lost(self) -> None:
        """After a failure: which of the records sent just before it does Redis still have?"""
        ids = [entry_id for sent_at, entry_id in self._recent if sent_at >= self._failed_at - self.LOSS_WINDOW_S]
        try:
            pipe = self._client.pipeline(transaction=False)
            for entry_id in ids:
                pipe.xrange(self.stream, entry_id, entry_id, count=1)
            lost = sum(1 for found in pipe.execute() if not found)
        except REDIS_ERRORS:
            return  # checked again before the next send
        self._failed_at = None
        self._recent.clear()
        if lost:
            self.lost += lost
            log.warning("event=redis_sink_records_lost stream=%s lost=%d checked=%d (Redis restarted without them)",
                        self.stream, lost, len(ids))

    def _take(self) -> list[SegmentRecord]:
        """Up to `batch` records: waits up to POLL_S for the first, takes the rest if ready."""
        try:
            records = [self._queue.get(timeout=self.POLL_S)]
        except queue.Empty:
            return []
        while len(records) < self.batch:
            try:
                records.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return records

    def _send(self, records: list[SegmentRecord]) -> None:
        encoded = [(r, p) for r in records if (p := self._encode(r)) is not None]
        payloads = [p for _, p in encoded]
        pipe = self._client.pipeline(transaction=False)
        for payload in payloads:
            pipe.xadd(self.stream, {RECORD_FIELD: payload}, maxlen=self.maxlen, approximate=True)
        try:
            ids = pipe.execute()
        except REDIS_ERRORS as exc:
            # Some XADDs of the batch may have landed: `dropped` is an upper bound here.
            self._dropped_on_send += len(payloads)
            self._dropped_tokens_on_send += sum(record_tokens(r) for r, _ in encoded)
            self._failed("send", exc, lost=len(payloads))
            drop_connections(self._client)
            return
        self.sent += len(payloads)
        now = time.monotonic()
        self._recent.extend((now, i.decode() if isinstance(i, bytes) else str(i)) for i in ids)
        while self._recent and self._recent[0][0] < now - self.LOSS_WINDOW_S:
            self._recent.popleft()

    def _encode(self, record: SegmentRecord) -> bytes | None:
        """The record's msgpack bytes, or None (dropped, counted) if it cannot be encoded."""
        try:
            return (record if self.content else strip_content(record)).to_msgpack()
        except Exception as exc:  # a malformed record must not kill the sender thread
            self._dropped_on_send += 1
            self._dropped_tokens_on_send += record_tokens(record)
            self.errors += 1
            log.error("event=redis_sink_encode_failed stream=%s request_id=%s segment=%s error=%r",
                      self.stream, getattr(record, "request_id", None),
                      getattr(record, "segment", None), exc)
            return None

    def _failed(self, what: str, exc: Exception, lost: int = 0) -> None:
        self.errors += 1
        if self._failed_at is None:
            self._failed_at = time.monotonic()
        if not self._outage_logged:  # one line per outage, not one per retry
            self._outage_logged = True
            log.warning("event=redis_sink_%s_failed stream=%s url=%s dropped=%d error=%r",
                        what, self.stream, _safe_url(self.url), lost, exc)
        self.connected = False

    def _drop_queued(self) -> None:
        left = 0
        while True:
            try:
                record = self._queue.get_nowait()
            except queue.Empty:
                break
            left += 1
            self._dropped_tokens_on_send += record_tokens(record)
        self._dropped_on_send += left
        if left:
            log.warning("event=redis_sink_closed_with_backlog stream=%s dropped=%d", self.stream, left)


def _safe_url(url: str) -> str:
    """The URL without its password, for logs."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"
