"""Progress events as JSON lines: one object per event, `{"time": unix seconds, "event": name, ...}`.

The drafter trainer writes one per optimizer step, evaluation, publish and rollback; the RL loop
one per GRPO step, evaluation and policy swap. Benchmarks and reports read these files; the logs
stay for people. Each event is one `write` of one line to a file opened for appending, so a
reader never sees half an event except possibly the last line of a file being written (skipped).
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class EventLog:
    def __init__(self, path: Path | None):
        """path None: events are kept in `recent` only (tests, benchmarks without a file)."""
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.recent: list[dict] = []

    def write(self, event: str, **fields) -> dict:
        entry = {"time": time.time(), "event": event, **fields}
        self.recent = [*self.recent[-255:], entry]
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry, default=str) + "\n")
        return entry


def read_events(path: Path, *events: str, since: float = 0.0) -> list[dict]:
    """The events of `path` (those named in `events`, or all) written at or after `since` (unix s)."""
    out = []
    lines = Path(path).read_text(errors="replace").splitlines() if Path(path).is_file() else []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:  # a line still being written
            continue
        if (not events or entry.get("event") in events) and entry.get("time", 0) >= since:
            out.append(entry)
    return out
