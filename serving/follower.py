"""A replica follows its deployment's `current` versions by itself.

Whoever moves `current` (a trainer after a publish, any replica's admin swap, a rollback) writes it with
`DeploymentVersions.set`: the store's pointer, and with Redis the deployment's hash plus one entry on its
control stream. Every replica runs a `Follower` on its event loop: it wakes on such an entry (XREAD BLOCK)
or every `follow_interval_s` at the latest (no Redis, Redis down, an entry missed), reads `current`, and
for each role this replica serves something else, swaps through the same path as the admin API
(`specrl.serving.swaps`: verified, loaded off the decode path, applied at a step boundary), in the mode
the announcement names (a policy swap of the RL loop interrupts, any other drains).

Bound: a replica that starts, restarts or missed an announcement serves `current` within one interval
plus the load (plus, for a drained policy swap, the time its old requests take to finish; the new
weights take every request admitted after the swap). With Redis, an announcement wakes it at once.

Ready (`/health`): every role serves `current`, or `current` failed to load here (bad checksum, missing,
shapes that do not fit): then the replica keeps serving its weights, as every failed swap leaves them,
says which version it is behind and why, counts the failure, and tries that version again after
RETRY_S. The first check runs in the server's startup, before it accepts a request (on uvicorn, before it
binds; on Ray Serve, before the replica is marked running); until one has run, `/health` says not ready.
"""

from __future__ import annotations

import asyncio
import logging
import time

from specrl.errors import SpecrlError
from specrl.serving.swaps import serving_versions, swap_to
from specrl.weights.deployment import DeploymentVersions

log = logging.getLogger("specrl.serving")

RETRY_S = 30.0  # a version that failed to load is tried again after this long (the failure may pass)


class Follower:
    def __init__(self, state, versions: DeploymentVersions):
        """state: the app's (`loop`, `store`, `metrics`, `swap_lock`)."""
        self.state, self.versions = state, versions
        self.current: dict[str, tuple[str, str]] | None = None  # None until the first check
        self.failed: dict[str, tuple[str, str, float]] = {}  # role -> (version, reason, when)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """The first check before the server takes a request (it runs in the app's startup), then the loop."""
        cursor = await asyncio.to_thread(self.versions.cursor)  # first: an announcement during the check wakes it
        await self._check_logged()
        self._task = asyncio.get_running_loop().create_task(self._run(cursor), name="specrl-follower")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self, cursor: str) -> None:
        while True:
            cursor = await asyncio.to_thread(self.versions.wait, cursor)
            await self._check_logged()

    async def _check_logged(self) -> None:
        try:
            await self.check()
        except Exception:  # noqa: BLE001 - the follower must outlive anything one check meets
            log.exception("event=follow_error")

    async def check(self) -> None:
        """Swap every role whose `current` this replica does not serve. The swap lock (the admin API's: one swap
        at a time) is taken only when there is something to swap, and `current` is read again under it, after
        any swap in flight has moved it; so a check never makes an admin swap wait or answer 409 for nothing."""
        current = await asyncio.to_thread(self.versions.get)
        if self._to_swap(current):
            async with self.state.swap_lock:
                current = await asyncio.to_thread(self.versions.get)
                for role, version, mode in self._to_swap(current):
                    try:
                        await swap_to(self.state, role, version, mode, origin="follow")
                    except SpecrlError as exc:
                        self.failed[role] = (version, exc.message, time.monotonic())
                        log.warning("event=follow_failed role=%s version=%s error=%s", role, version, exc.message)
        serving = serving_versions(self.state.loop)
        for role in [r for r, (version, *_) in self.failed.items() if current.get(r, (None,))[0] != version
                     or serving[r] == version]:
            del self.failed[role]  # current moved on, or serves: that failure is over
        self.current = current

    def _to_swap(self, current: dict[str, tuple[str, str]]) -> list[tuple[str, str, str]]:
        """-> (role, version, mode) for each role served off `current`, skipping a version that failed here less
        than RETRY_S ago."""
        serving, out = serving_versions(self.state.loop), []
        for role, (version, mode) in current.items():
            if serving[role] == version or (role == "drafter" and not self.state.loop.has_drafter):
                continue
            failed = self.failed.get(role)
            if failed and failed[0] == version and time.monotonic() - failed[2] < RETRY_S:
                continue
            out.append((role, version, mode))
        return out

    def health(self) -> dict:
        """-> {"ready", "current": {role: version}, "behind": {role: {"version", "reason"}}} as of the last check.
        Ready once a check has run: each role then serves `current` or is behind it with a reason (a check
        returns after its swaps took effect)."""
        if self.current is None:
            return {"ready": False, "current": {}, "behind": {}, "reason": "the first check of current has not run"}
        behind = {role: {"version": version, "reason": self.failed[role][1]}
                  for role, (version, _) in self.current.items() if role in self.failed}
        return {"ready": True, "current": {role: version for role, (version, _) in self.current.items()},
                "behind": behind}
