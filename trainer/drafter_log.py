"""Reading the drafter trainer's log: its `event=evaluate|publish|rollback` lines, which the
benchmarks (`bench adapt`) and reports (`specrl rl`) turn into curves and lags."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

LOG_LINE = re.compile(r"ts=(\S+ \S+) level=\S+ logger=\S+ msg=event=(evaluate|publish|rollback) (.*)")


def trainer_events(log: Path) -> list[dict]:
    """`event=evaluate|publish|rollback` lines of the trainer log -> dicts with `time` (unix s)."""
    events = []
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        match = LOG_LINE.match(line)
        if match:
            stamp, event, rest = match.groups()
            fields = dict(re.findall(r"(\w+)=(\S+)", rest))
            events.append({"time": datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp(), "event": event,
                           **fields})
    return events
