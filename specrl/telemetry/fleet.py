"""Learning from the fleet: other replicas' finished requests, from the event stream into the suffix index.

Every replica appends its records to `{specrl:<deployment>}:events`; `FleetFeed` reads that stream
on a background thread with plain XREAD (no consumer group: every replica reads every record),
from the entries that arrive after it starts, and rebuilds each request from its segments (the
prompt in segment 0, the committed tokens of every segment; the last one carries a finish
reason). A request that ended goes into the index once (the index dedupes by request id: at most
once per record even when the stream is read again after a reconnect). Records of this replica
are skipped (its engine adds its own requests the moment they end), and so are records without
content (`telemetry_content` off). The lag is the XREAD block time plus the sender's batching.

Bounded: at most `max_open` requests are being rebuilt at once (the oldest is dropped); a
request whose segments arrive out of order (a dropped record) is dropped. Redis trouble (down,
restarted, slow) is waited out with backoff on this thread: serving never sees it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict


from specrl.redis_conn import REDIS_ERRORS, connect
from specrl.telemetry.record import SegmentRecord
from specrl.telemetry.redis_sink import RECORD_FIELD

log = logging.getLogger(__name__)


class FleetFeed:
    BLOCK_MS = 1000
    BACKOFF_MAX_S = 10.0

    def __init__(self, url: str, stream: str, replica: str, index, *, deployment: str | None = None,
                 max_open: int = 4096):
        """index: a `SuffixIndex` (add(key, tokens) -> bool). deployment: keep only its records."""
        self.stream, self.replica, self.index, self.deployment = stream, replica, index, deployment
        self.max_open = max_open
        self._redis = connect(url, socket_timeout=self.BLOCK_MS / 1000 + 5, protocol=2)
        self._open: OrderedDict[str, tuple[list[int], int]] = OrderedDict()  # request -> (tokens, next segment)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specrl-fleet-feed", daemon=True)
        self.added = self.skipped = self.dropped = self.errors = 0
        self._last_id = "$"

    def start(self) -> "FleetFeed":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        self._redis.close()

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                reply = self._redis.xread({self.stream: self._last_id}, count=256, block=self.BLOCK_MS)
                backoff = 0.1
            except REDIS_ERRORS as exc:
                self.errors += 1
                if self.errors <= 3:
                    log.warning("event=fleet_feed_error stream=%s error=%r retry_in_s=%.1f", self.stream, exc, backoff)
                self._stop.wait(backoff)
                backoff = min(2 * backoff, self.BACKOFF_MAX_S)
                continue
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    self.take(fields.get(RECORD_FIELD.encode(), b""))

    def take(self, payload: bytes) -> None:
        """One stream entry's payload (the msgpack record)."""
        try:
            record = SegmentRecord.from_msgpack(payload)
        except (ValueError, TypeError, KeyError):
            self.skipped += 1  # the trainer dead-letters it; here it is just not traffic to learn from
            return
        if record.replica == self.replica or (self.deployment and record.deployment != self.deployment):
            return
        if record.segment == 0:
            if record.prompt_ids is None:  # content off
                self.skipped += 1
                return
            self._open[record.request_id] = (list(record.prompt_ids), 0)
            while len(self._open) > self.max_open:
                self._open.popitem(last=False)
                self.dropped += 1
        opened = self._open.get(record.request_id)
        if opened is None or opened[1] != record.segment:
            self.dropped += opened is not None
            self._open.pop(record.request_id, None)
            return
        tokens = opened[0] + list(record.tokens)
        if record.finish_reason is None:
            self._open[record.request_id] = (tokens, record.segment + 1)
            return
        del self._open[record.request_id]
        if self.index.add(record.request_id, tokens):
            self.added += 1
