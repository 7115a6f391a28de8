"""Redis connections and key names, one place for every process: a single server or a Redis Cluster.

Every key of one deployment carries the hash tag `{specrl:<deployment>}` (`deployment_key`), so on a Redis Cluster
the event stream, its consumer groups and pending lists, its dead-letter stream, the `current` hash and the control
stream all live on one slot: a pipeline or transaction over them stays on one node, and a failover moves them
together.

`connect(url)` asks the server at `url` whether it is a cluster node (`INFO cluster`) and returns redis-py's
`RedisCluster` for a cluster (it discovers the other nodes and follows MOVED/ASK), else a plain `Redis` client. A
server that does not answer the question is taken as a single node (a cluster must be up when a process starts;
a single server may come up later).
"""

from __future__ import annotations

import redis
from redis.cluster import RedisCluster

# What a Redis call raises when Redis is in trouble. redis-py 8.2's cluster client raises AttributeError ("'NoneType'
# object has no attribute 'host'", recording an error metric) when a node refuses the connection; a loop that must
# live through an outage (the sink's sender, the follower, the trainer's reader) catches both.
REDIS_ERRORS = (redis.RedisError, AttributeError)

# Options a cluster client takes from the caller; others configure the plain client only. `retry` matters most: the
# cluster client's own (3 attempts, refreshing the slot table between them) hides a failover from its caller, and a
# caller that must notice one (the sink, which then checks which of its records the old master took with it) passes
# `Retry(NoBackoff(), 0)`.
_CLUSTER_OPTIONS = ("socket_timeout", "socket_connect_timeout", "decode_responses", "protocol", "retry")


def deployment_key(deployment: str, name: str) -> str:
    """The Redis key `name` of `deployment`: `{specrl:<deployment>}:<name>` (one hash slot per deployment)."""
    return f"{{specrl:{deployment}}}:{name}"


def connect(url: str, **options) -> redis.Redis | RedisCluster:
    """A client for the Redis at `url`: RedisCluster when it is a cluster node, else Redis (`options`: redis-py's
    connection options). A malformed URL raises ValueError here."""
    client = redis.Redis.from_url(url, **options)
    try:
        probe = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
        try:
            cluster = bool(probe.info("cluster").get("cluster_enabled"))
        finally:
            probe.close()
    except redis.RedisError:
        return client
    if not cluster:
        return client
    client.close()
    return RedisCluster.from_url(url, **{k: v for k, v in options.items() if k in _CLUSTER_OPTIONS})


def drop_connections(client: redis.Redis | RedisCluster) -> None:
    """Close every socket of `client` (the next command opens new ones): after a failed call, so that a reply left
    half read on a socket is never read as the next command's. A cluster client also refreshes its slot table on
    its next command that fails over."""
    if isinstance(client, RedisCluster):
        client.close()
    else:
        client.connection_pool.disconnect()
