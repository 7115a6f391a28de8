"""Closed-loop clients of the fleet benches (`bench fleet`'s publish/restart and autoscale scenarios): each client
sends its next short completion when the last is answered; every request's (start, end, tokens, ok) is kept."""

from __future__ import annotations

import threading
import time

TIMEOUT_S = 60.0
RETRY_AFTER_S = 0.2  # a client whose request failed waits this long: no busy loop against a replica gone


class FleetClients:
    """As many clients as `set_users` says (added or stopped one by one); `requests` in completion order."""

    def __init__(self, url: str, model: str, max_tokens: int):
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.requests: list[tuple[float, float, int, bool]] = []  # (start, end) monotonic s, tokens, ok
        self._threads: list[tuple[threading.Thread, threading.Event]] = []

    @property
    def ok(self) -> int:
        return sum(r[3] for r in self.requests)

    @property
    def failed(self) -> int:
        return sum(not r[3] for r in self.requests)

    def set_users(self, users: int) -> "FleetClients":
        while len(self._threads) > users:  # the newest first; each finishes its request in flight
            thread, stop = self._threads.pop()
            stop.set()
            thread.join(timeout=TIMEOUT_S)
        while len(self._threads) < users:
            stop = threading.Event()
            thread = threading.Thread(target=self._user, args=(len(self._threads), stop), daemon=True)
            self._threads.append((thread, stop))
            thread.start()
        return self

    def _user(self, user: int, stop: threading.Event) -> None:
        import httpx

        i = 0
        with httpx.Client(timeout=TIMEOUT_S) as http:
            while not stop.is_set():
                i += 1
                body = {"model": self.model, "prompt": f"User {user}, question {i}: tell me about the number {i}.",
                        "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
                began = time.monotonic()
                try:
                    response = http.post(self.url + "/v1/completions", json=body)
                    ok = response.status_code == 200
                    tokens = response.json()["usage"]["completion_tokens"] if ok else 0
                except httpx.HTTPError:
                    ok, tokens = False, 0
                self.requests.append((began, time.monotonic(), tokens, ok))
                if not ok:
                    stop.wait(RETRY_AFTER_S)
