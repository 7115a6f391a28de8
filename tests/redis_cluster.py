"""A real local Redis Cluster for tests: `masters` masters, each with `replicas` replicas (`redis-server
--cluster-enabled yes` on loopback ports, joined by `redis-cli --cluster create`), started and stopped by the test."""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.cluster import key_slot

from specrl.apps.launch import free_port

NODE_TIMEOUT_MS = 1000  # how long a master may not answer before its replica is promoted


@dataclass
class RedisCluster:
    url: str
    nodes: dict[int, subprocess.Popen] = field(default_factory=dict)  # port -> its redis-server
    commands: dict[int, list[str]] = field(default_factory=dict)  # port -> how it was started

    def master_of(self, key: str) -> int:
        """The port of the master that serves `key`'s slot now."""
        slot = key_slot(key.encode())
        for port, node in self.nodes.items():
            if node.poll() is None:
                try:
                    for start, end, master, *_ in redis.Redis(port=port).execute_command("CLUSTER SLOTS"):
                        if start <= slot <= end:
                            return int(master[1])
                except redis.RedisError:
                    continue
        raise RuntimeError(f"no live node knows slot {slot}")

    def replicas_caught_up(self, master: int) -> bool:
        """Whether `master` has replicas and each has applied all of its writes (replication offsets equal)."""
        info = redis.Redis(port=master).info("replication")
        slaves = [info[k] for k in info if k.startswith("slave") and isinstance(info[k], dict)]
        return bool(slaves) and all(s["offset"] == info["master_repl_offset"] for s in slaves)

    def master_of_port(self, port: int) -> int:
        """The port of `port`'s master (itself when it is one)."""
        info = redis.Redis(port=port).info("replication")
        return port if info["role"] == "master" else int(info["master_port"])

    def caught_up_masters(self) -> list[int]:
        return [p for p, node in self.nodes.items() if node.poll() is None and self.master_of_port(p) == p
                and self.replicas_caught_up(p)]

    def replicas_of(self, master: int) -> list[int]:
        """The live nodes that replicate `master` now."""
        return [p for p, node in self.nodes.items()
                if p != master and node.poll() is None and self.master_of_port(p) == master]

    def agreed_master_of(self, key: str) -> int | None:
        """The master every live node names for `key`'s slot, or None while they disagree (a failover spreading)."""
        slot, named = key_slot(key.encode()), set()
        for port, node in self.nodes.items():
            if node.poll() is None:
                slots = redis.Redis(port=port).execute_command("CLUSTER SLOTS")
                named |= {int(master[1]) for start, end, master, *_ in slots if start <= slot <= end} or {None}
        return named.pop() if len(named) == 1 else None

    def fail_over(self, dead: int, replica: int, key: str, election_s: float = 10.0) -> str:
        """Wait for `replica` to serve `key` in place of the killed master `dead`, as every live node sees it.

        The cluster elects it by itself once a majority of masters mark `dead` failed (~2.5 s here with
        a 1 s node timeout, both cores busy or not). Should the vote not come within `election_s`, the
        replica takes over without one (`CLUSTER FAILOVER TAKEOVER`), as an operator would, so that the
        test is about the sink, not the election. Returns "elected" or "takeover" (the test prints it).
        """
        how = "elected"
        try:
            wait_until(lambda: self.master_of_port(replica) == replica, timeout_s=election_s, what="an election")
        except TimeoutError:
            how = "takeover"
            try:
                redis.Redis(port=replica).execute_command("CLUSTER FAILOVER", "TAKEOVER")
            except redis.ResponseError:  # elected between the timeout and the command: already a master
                pass
        wait_until(lambda: self.agreed_master_of(key) == replica, timeout_s=60,
                   what=f"every node to name {replica} as the master of {key!r} (failover: {how})")
        return how

    def kill(self, port: int) -> None:
        self.nodes[port].send_signal(signal.SIGKILL)
        self.nodes[port].wait(timeout=30)

    def restart(self, port: int) -> None:
        """Start a killed node again: it rejoins with the slots its config file names, without its data."""
        self.nodes[port] = subprocess.Popen(self.commands[port], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        for node in self.nodes.values():
            if node.poll() is None:
                node.terminate()
        for node in self.nodes.values():
            node.wait(timeout=30)


def start_cluster(data: Path, masters: int = 3, replicas: int = 0) -> RedisCluster:
    # Each node's cluster bus port defaults to its port + 10000, which lands in the kernel's ephemeral range, where
    # any outgoing connection may hold it and the node exits at start (CI: "waited 30 s for the Redis cluster to
    # come up"): every node gets a bus port of its own from below that range too.
    count = masters * (1 + replicas)
    chosen: list[int] = []
    while len(chosen) < 2 * count:
        port = free_port()
        if port not in chosen:
            chosen.append(port)
    ports, bus_ports = chosen[:count], dict(zip(chosen[:count], chosen[count:]))
    cluster = RedisCluster(f"redis://127.0.0.1:{ports[0]}")
    try:
        for port in ports:
            (data / str(port)).mkdir(parents=True)
            cluster.commands[port] = [
                "redis-server", "--port", str(port), "--cluster-port", str(bus_ports[port]), "--bind", "127.0.0.1",
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(data / str(port) / "nodes.conf"), "--cluster-node-timeout",
                str(NODE_TIMEOUT_MS),
                # A replica elects itself however long ago it last heard from its master: Redis 7.0 may take a link
                # that never dropped as down since the epoch and refuse ("disconnected for longer than allowed").
                "--cluster-replica-validity-factor", "0",
                "--save", "", "--appendonly", "no", "--dir", str(data / str(port))]
            cluster.restart(port)
        for port in ports:
            wait_until(lambda: redis.Redis(port=port).ping())
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                        "--cluster-replicas", str(replicas), "--cluster-yes"], check=True, capture_output=True,
                       timeout=60)
        for port in ports:
            wait_until(lambda: redis.Redis(port=port).cluster("info")["cluster_state"] == "ok")
        if replicas:  # every master's replicas attached and synced
            wait_until(lambda: sorted(cluster.caught_up_masters()) == sorted(
                {cluster.master_of_port(p) for p in ports}))
    except BaseException:
        cluster.stop()
        raise
    return cluster


def wait_until(ready, timeout_s: float = 30.0, what: str = "the Redis cluster to come up") -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ready():
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g} s for {what}")
        time.sleep(0.1)
