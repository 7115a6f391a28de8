"""The trainer's side of the events stream: a consumer-group reader of segment records.

`RecordReader` reads the stream `RedisSink` writes (one entry per record, field `r` holding
`SegmentRecord.to_msgpack()`) as one consumer of a group:
- `read` first re-delivers this consumer's own pending entries (delivered before, never acked:
  the previous run of this consumer died), page by page, then new entries;
- an entry that does not decode (bad msgpack, other schema, missing field) is a poison entry:
  it is copied to the dead-letter stream with the reason, acked, and not returned;
- an entry deleted from the stream while pending (MAXLEN trimming) is acked and skipped;
- `ack` after the records were used (the trainer: after the optimizer step that used them);
- `claim_stale` takes over entries another consumer left pending for too long (XAUTOCLAIM).

Delivery is at least once: a record can come back after a crash or a claim, so the caller
dedupes by (request_id, segment).
"""

from __future__ import annotations

import logging

import redis

from specrl.redis_conn import connect
from specrl.telemetry.record import SegmentRecord
from specrl.telemetry.redis_sink import RECORD_FIELD

log = logging.getLogger(__name__)

DEAD_LETTER_SUFFIX = ":dead"  # default dead-letter stream: <stream>:dead
DEAD_LETTER_MAXLEN = 10_000  # poison entries kept (approximately) for inspection

Entry = tuple[str, SegmentRecord]  # (stream entry id, decoded record)


class RecordReader:
    """One consumer (`consumer`, a stable name per trainer process) of group `group` on `stream`.

    Dead-letter entries (on `dead_letter_stream`, by default `<stream>:dead`) have the fields
    `r` (the raw payload, b"" when missing), `id` (the entry id in `stream`), `reason`,
    `stream`, `group`, `consumer`.

    Counters: `dead_lettered` (poison entries moved), `trimmed` (pending entries found deleted).
    Redis errors (server down, no such group) propagate: the trainer decides how to wait.
    """

    SOCKET_TIMEOUT_S = 30.0  # a blocking `read` must use block_ms below this

    def __init__(self, url: str, stream: str, group: str, consumer: str, *,
                 dead_letter_stream: str | None = None):
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.dead_letter_stream = dead_letter_stream or stream + DEAD_LETTER_SUFFIX
        self.dead_lettered = 0
        self.trimmed = 0
        self._redis = connect(url, socket_timeout=self.SOCKET_TIMEOUT_S, protocol=2)
        self._pending_cursor: str | None = "0"  # None once our own pending entries are read

    def close(self) -> None:
        self._redis.close()

    def ensure_group(self) -> None:
        """Create the group (and the stream) if missing; the group starts at the stream's start."""
        try:
            self._redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, count: int = 100, block_ms: int | None = None) -> list[Entry]:
        """Up to `count` records: this consumer's pending ones first, then new ones (waiting up
        to `block_ms` for them; None returns at once). Poison entries are dead-lettered, so a
        call can return fewer than `count`, or none, while more wait."""
        while self._pending_cursor is not None:
            entries = self._xreadgroup(self._pending_cursor, count, None)
            if not entries:
                self._pending_cursor = None
                break
            self._pending_cursor = entries[-1][0].decode()
            records = self._decode(entries)
            if records:
                return records
        return self._decode(self._xreadgroup(">", count, block_ms))

    def ack(self, ids: list[str]) -> int:
        """Acknowledge entries (their records were used); returns how many were pending."""
        if not ids:
            return 0
        return self._redis.xack(self.stream, self.group, *ids)

    def claim_stale(self, min_idle_ms: int, count: int = 100) -> list[Entry]:
        """Take over up to `count` entries pending for at least `min_idle_ms` in the group,
        from any consumer (ours included), and return them decoded like `read`. Pick
        `min_idle_ms` above the longest time a live trainer holds records before acking."""
        entries: list = []
        cursor = "0-0"
        while len(entries) < count:  # one pass over the group's pending list at most
            cursor, claimed, *deleted = self._redis.xautoclaim(
                self.stream, self.group, self.consumer, min_idle_ms,
                start_id=cursor, count=count - len(entries))
            entries.extend(claimed)
            self.trimmed += len(deleted[0]) if deleted else 0  # Redis 7 drops these from the PEL
            if cursor in (b"0-0", "0-0"):
                break
        return self._decode(entries)

    def lag(self) -> int:
        """Entries the group has not yet been delivered (XINFO GROUPS `lag`, Redis >= 7); the
        group's pending count where the server cannot tell the lag."""
        for info in self._redis.xinfo_groups(self.stream):
            if info["name"].decode() == self.group:
                lag = info.get("lag")
                return int(lag) if lag is not None else int(info["pending"])
        raise redis.ResponseError(f"NOGROUP no group {self.group!r} on stream {self.stream!r}")

    def flow(self) -> dict:
        """The stream seen from the group, in one round trip, without reading a payload:
        `added` (entries ever added: XINFO GROUPS entries-read + lag, Redis >= 7; else the
        stream length), `lag` (not yet delivered to the group), `last_delivered_ms` (the Redis
        clock of the last entry delivered, 0 for none) and `now_ms` (Redis TIME)."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.xinfo_groups(self.stream)
        pipe.xlen(self.stream)
        pipe.time()
        groups, length, (seconds, micros) = pipe.execute()
        for info in groups:
            if info["name"].decode() == self.group:
                lag, read = info.get("lag"), info.get("entries-read")
                delivered = info["last-delivered-id"].decode().partition("-")[0]
                return {"added": int(read) + int(lag) if lag is not None and read is not None else int(length),
                        "lag": int(lag) if lag is not None else int(info["pending"]),
                        "last_delivered_ms": int(delivered), "now_ms": seconds * 1000 + micros // 1000}
        raise redis.ResponseError(f"NOGROUP no group {self.group!r} on stream {self.stream!r}")

    # -- decoding --------------------------------------------------------------------------

    def _xreadgroup(self, from_id: str, count: int, block_ms: int | None) -> list:
        response = self._redis.xreadgroup(self.group, self.consumer, {self.stream: from_id},
                                          count=count, block=block_ms)
        return [e for _stream, entries in response for e in entries]  # RESP2 shape

    def _decode(self, entries: list) -> list[Entry]:
        """Decoded records; poison entries are dead-lettered and acked, deleted ones acked."""
        records: list[Entry] = []
        discard: list[str] = []
        for raw_id, fields in entries:
            if raw_id is None:  # Redis 6.2 XAUTOCLAIM: a deleted entry, already gone from the PEL
                continue
            entry_id = raw_id.decode()
            if not fields:  # deleted from the stream (trimmed) while pending
                self.trimmed += 1
                discard.append(entry_id)
                continue
            payload = fields.get(RECORD_FIELD.encode())
            if payload is None:
                self.dead_letter(entry_id, b"", f"no field {RECORD_FIELD!r} in the entry")
                discard.append(entry_id)
                continue
            try:
                records.append((entry_id, SegmentRecord.from_msgpack(payload)))
            except Exception as exc:  # any decode failure makes a poison entry, never a crash
                self.dead_letter(entry_id, payload, f"{type(exc).__name__}: {exc}")
                discard.append(entry_id)
        self.ack(discard)
        return records

    def dead_letter(self, entry_id: str, payload: bytes, reason: str) -> None:
        self.dead_lettered += 1
        log.warning("event=poison_record stream=%s id=%s group=%s consumer=%s reason=%r",
                    self.stream, entry_id, self.group, self.consumer, reason)
        self._redis.xadd(self.dead_letter_stream, {
            RECORD_FIELD: payload,
            "id": entry_id, "reason": reason, "stream": self.stream,
            "group": self.group, "consumer": self.consumer,
        }, maxlen=DEAD_LETTER_MAXLEN, approximate=True)

