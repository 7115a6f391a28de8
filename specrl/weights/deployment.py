"""The versions a deployment should serve, and how every replica hears that they changed.

`current` is one value per role (policy, drafter) for the whole deployment, kept in two places:
  - the store's `current` pointer (`WeightsStore.set_current`): durable, what a replica loads when it starts;
  - with Redis, the hash `{specrl:<deployment>}:current` ({role: version, <role>_mode: swap mode}) and one entry
    per change on the stream `{specrl:<deployment>}:control`: how replicas that share no disk learn of a change,
    and wake at once (XREAD BLOCK) instead of at their next poll.
`set` writes the store first, then Redis; `get` reads Redis's hash where it names a role, else the store's
pointer (no Redis, Redis down, or a role never announced there). Redis trouble is never raised: it is
counted (`redis_errors`) and the store answers.

Writers: a server after a swap through its admin API (an operator's swap, a trainer's push, a rollback) and a
trainer after a publish. Readers: every replica's follower (`specrl.serving.follower`).
"""

from __future__ import annotations

import logging
import time


from specrl.redis_conn import REDIS_ERRORS, connect, deployment_key
from specrl.weights.store import ROLES, WeightsStore

log = logging.getLogger(__name__)

DEFAULT_MODE = "drain"
CONTROL_MAXLEN = 1000  # announcements kept on the control stream (a replica needs only the newest)


def current_key(deployment: str) -> str:
    return deployment_key(deployment, "current")


def control_stream(deployment: str) -> str:
    return deployment_key(deployment, "control")


class DeploymentVersions:
    def __init__(self, store: WeightsStore, redis_url: str | None, deployment: str, *, wait_s: float = 2.0):
        """redis_url None or "": the store alone (one machine, one shared directory). wait_s: how long `wait`
        blocks at most."""
        self.store, self.deployment, self.wait_s = store, deployment, wait_s
        self.key, self.stream = current_key(deployment), control_stream(deployment)
        self._redis = (connect(redis_url, socket_timeout=wait_s + 5, socket_connect_timeout=2, decode_responses=True,
                               protocol=2) if redis_url else None)
        self.redis_errors = 0

    def set(self, role: str, version: str, mode: str = DEFAULT_MODE) -> None:
        """Make `version` the deployment's current `role` (it must be in the store), then tell every replica."""
        self.store.set_current(role, version)
        if self._redis is None:
            return
        try:
            pipe = self._redis.pipeline(transaction=True)
            pipe.hset(self.key, mapping={role: version, f"{role}_mode": mode})
            pipe.xadd(self.stream, {"role": role, "version": version, "mode": mode}, maxlen=CONTROL_MAXLEN,
                      approximate=True)
            pipe.execute()
        except REDIS_ERRORS as exc:
            self._redis_failed("set", exc)

    def get(self) -> dict[str, tuple[str, str]]:
        """-> {role: (version, swap mode)} for the roles that have a current version."""
        announced = {}
        if self._redis is not None:
            try:
                announced = self._redis.hgetall(self.key)
            except REDIS_ERRORS as exc:
                self._redis_failed("get", exc)
        out = {}
        for role in ROLES:
            version = announced.get(role) or self.store.current(role)
            if version:
                out[role] = (version, announced.get(f"{role}_mode", DEFAULT_MODE) if role in announced else DEFAULT_MODE)
        return out

    def cursor(self) -> str:
        """The control stream's newest entry id now ("0-0" when empty or without Redis): `wait` after it."""
        if self._redis is None:
            return "0-0"
        try:
            newest = self._redis.xrevrange(self.stream, count=1)
            return newest[0][0] if newest else "0-0"
        except REDIS_ERRORS as exc:
            self._redis_failed("cursor", exc)
            return "0-0"

    def wait(self, after: str) -> str:
        """Block until an announcement newer than `after` arrives, or `wait_s` -> the newest id seen. Without
        Redis (or while it is down) this is a sleep: the caller then polls `get`."""
        if self._redis is not None:
            try:
                reply = self._redis.xread({self.stream: after}, count=CONTROL_MAXLEN, block=max(1, int(self.wait_s * 1000)))
                return reply[0][1][-1][0] if reply else after
            except REDIS_ERRORS as exc:
                self._redis_failed("wait", exc)
        time.sleep(self.wait_s)
        return after

    def clear(self) -> None:
        """Drop the deployment's Redis keys (tests, and a new deployment reusing a name)."""
        if self._redis is not None:
            self._redis.delete(self.key, self.stream)

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()

    def _redis_failed(self, what: str, exc: Exception) -> None:
        self.redis_errors += 1
        log.warning("event=redis_error op=%s deployment=%s error=%s", what, self.deployment, exc)
