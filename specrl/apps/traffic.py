"""Replayed traffic: concurrent clients sending a prompt mix through the chat API (`specrl up
--demo`, `specrl bench adapt`). Standard library HTTP only."""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.request


class Traffic:
    """`users` clients replaying a prompt mix through the chat API (greedy, `max_tokens` tokens)."""

    def __init__(self, url: str, model: str, users: int, max_tokens: int = 64):
        self.url, self.model, self.users, self.max_tokens = url, model, users, max_tokens
        self.requests = self.tokens = self.failures = 0
        self.lock = threading.Lock()

    def serve(self, mix, seconds: float = math.inf, tick=None, until: threading.Event | None = None) -> None:
        """Replay `mix` for `seconds` (or until `until` is set), then let in-flight requests finish.
        `tick()` runs each second."""
        stop = threading.Event()
        users = [threading.Thread(target=self._user, args=(mix, stop), daemon=True) for _ in range(self.users)]
        for user in users:
            user.start()
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline and not (until is not None and until.is_set()):
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                if tick is not None:
                    tick()
        finally:
            stop.set()
            for user in users:
                user.join()

    def _user(self, mix, stop: threading.Event) -> None:
        from specrl.data import as_messages

        while not stop.is_set():
            with self.lock:
                prompt = next(mix)
            body = {"model": self.model, "messages": as_messages(prompt), "max_tokens": self.max_tokens,
                    "temperature": 0}
            request = urllib.request.Request(self.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=300) as resp:
                    usage = json.loads(resp.read())["usage"]
            except (OSError, ValueError, KeyError):
                with self.lock:
                    self.failures += 1
                stop.wait(1.0)
                continue
            with self.lock:
                self.requests += 1
                self.tokens += usage["completion_tokens"]
