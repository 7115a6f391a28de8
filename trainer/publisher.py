"""Publish a drafter into the weights store and make it the deployment's current drafter.

The replicas this trainer knows (`--servers`) are asked over their admin API first, the fast path: one
that is down is retried a few times and reported, the others still swap. Then the deployment's
`current` moves (`DeploymentVersions`: the store's pointer, Redis's hash and control stream), which
every replica follows by itself, those the trainer does not know included. Uses only the standard
library's HTTP client.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specrl.models.drafter import EagleDrafter
from specrl.weights import WeightsStore
from specrl.weights.deployment import DeploymentVersions
from specrl.weights.object_store import DurableStore, share

log = logging.getLogger("specrl.trainer")


@dataclass
class SwapReport:
    version: str
    swapped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # replica URL -> last error
    announced: bool = False  # the deployment's current moved to it (every replica follows)

    @property
    def serving(self) -> bool:
        """Replicas serve it now or will within their follow interval."""
        return bool(self.swapped) or self.announced


class Publisher:
    def __init__(self, store: WeightsStore, servers: list[str], admin_token: str, *, retries: int = 3,
                 backoff_s: float = 0.5, timeout_s: float = 60.0, versions: DeploymentVersions | None = None,
                 durable: DurableStore | None = None):
        """versions: the deployment's current versions, moved after the pushes (None: the pushes alone); durable:
        where replicas without this store's disk pull from (`--durable-store`), written after each publish."""
        self.store, self.servers, self.admin_token, self.versions = store, servers, admin_token, versions
        self.durable = durable
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, timeout_s

    def publish(self, drafter: EagleDrafter, *, parent: str | None, target_version: str, metrics: dict,
                version: str | None = None) -> str:
        """Store `drafter` as a new version (the next vN, or `version`) -> its version name."""
        with tempfile.TemporaryDirectory() as tmp:
            drafter.save(Path(tmp))
            manifest = self.store.publish("drafter", tmp, version=version, parent=parent,
                                          target_version=target_version, metrics=metrics,
                                          architecture={"drafter": drafter.cfg.architecture})
        if self.versions is not None:  # a durable store elsewhere, and on Ray the object store: replicas pull there
            share(self.versions.deployment, self.store, "drafter", manifest.version, self.durable)
        return manifest.version

    def swap(self, version: str) -> SwapReport:
        """Ask every known replica to serve drafter `version`, then make it the deployment's current (also how
        a rollback is done: by naming the previous version, which stays correct if a retried request had
        already landed)."""
        report = SwapReport(version)
        for server in self.servers:
            _, error = post_swap(server, self.admin_token, {"role": "drafter", "version": version},
                                 retries=self.retries, backoff_s=self.backoff_s, timeout_s=self.timeout_s)
            if error is None:
                report.swapped.append(server)
            else:
                report.failed[server] = error
                log.warning("event=swap_failed replica=%s version=%s error=%s", server, version, error)
        if self.versions is not None and (report.swapped or not self.servers):
            self.versions.set("drafter", version)  # a version every known replica refused is not made current
            report.announced = True
        return report


def post_swap(server: str, admin_token: str, body: dict, *, retries: int = 3, backoff_s: float = 0.5,
              timeout_s: float = 60.0) -> tuple[dict | None, str | None]:
    """POST `body` to a replica's /admin/weights with retries -> (its answer, None), or (None, the
    last error). Retried: connection errors, 5xx, and 409 (a swap already in flight there: the
    drafter trainer's and the RL loop's policy swaps cross); any other 4xx is the replica refusing
    the checkpoint, which retrying will not change."""
    error = "not tried"
    for attempt in range(retries):
        request = urllib.request.Request(server.rstrip("/") + "/admin/weights", data=json.dumps(body).encode(),
                                         method="POST", headers={"Content-Type": "application/json",
                                                                 "Authorization": f"Bearer {admin_token}"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                return json.loads(resp.read() or b"{}"), None
        except urllib.error.HTTPError as exc:
            error = f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:300]}"
            if exc.code < 500 and exc.code != 409:
                return None, error
        except (urllib.error.URLError, OSError) as exc:
            error = str(exc)
        if attempt + 1 < retries:
            time.sleep(backoff_s * 2 ** attempt)
    return None, error
