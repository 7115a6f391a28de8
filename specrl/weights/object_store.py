"""Weights without a shared disk: a version published once into Ray's object store, pulled by every replica.

On Ray the trainer publishes a version into its store (a directory, the durable copy) and then into the object
store (`publish_object`): the version's files become one object owned by the deployment's registry, a detached
actor named `specrl-weights:<deployment>` that puts them itself (so it owns the object), so the object outlives
the trainer that sent it (a trainer that restarts republishes nothing it already published). The registry keeps the newest
KEEP versions of each role and drops older ones (Ray frees an object once nothing holds it).

A replica that must serve a version it does not have (`pull`) takes it from, in order: its own store (verified),
the object store (the registry's object, over Ray's transfer from the node that holds it), or the durable store
(`DurableStore`: any fsspec URL; tested: a directory, `file://`, `s3://` through s3fs against an S3 server). Whatever it
got is written into its own store by `WeightsStore.install`, which checks every file against the publisher's
manifest (names, bytes, sha256) before the version appears there: a copy that does not verify never reaches a
swap. Every try is counted by source and outcome (`Pulls`). Needs the `[ray]` extra for the object store; the
durable path works without Ray.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

from specrl.errors import CorruptWeightsError, InvalidRequestError, WeightsError, WeightsNotFoundError
from specrl.weights.store import MANIFEST, Manifest, WeightsStore

KEEP = 4  # versions per role the registry holds
NAMESPACE = "specrl"
log = logging.getLogger("specrl.weights")


class WeightsRegistry:
    """The detached actor that owns each published version's object: (role, version) -> (manifest, [ref])."""

    def __init__(self):
        self.entries: dict[tuple[str, str], tuple[dict, list]] = {}

    def register(self, role: str, version: str, manifest: dict, files: dict[str, bytes]) -> None:
        """Put the files into the object store from here, so that this actor owns the object (Ray frees an object
        when its owner dies; `ray.put`'s `_owner` is gone since Ray 2.56)."""
        import ray

        self.entries[(role, version)] = (manifest, [ray.put(files)])  # in a list: Ray hands back the ref
        kept = [key for key in self.entries if key[0] == role]
        for key in kept[:-KEEP]:  # insertion order: the oldest first
            del self.entries[key]

    def lookup(self, role: str, version: str) -> tuple[dict, list] | None:
        return self.entries.get((role, version))

    def forget(self, role: str, version: str) -> bool:
        return self.entries.pop((role, version), None) is not None


def registry(deployment: str, create: bool = False):
    """The deployment's registry actor (started when `create` and absent), or None."""
    import ray

    name = f"specrl-weights:{deployment}"
    if create:
        actor = ray.remote(num_cpus=0)(WeightsRegistry)
        return actor.options(name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True).remote()
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def publish_object(deployment: str, store: WeightsStore, role: str, version: str) -> None:
    """Put a version of `store` into the object store, owned by the deployment's registry."""
    import ray

    owner = registry(deployment, create=True)
    manifest, files = store.read_version(role, version)
    ray.get(owner.register.remote(role, version, manifest.to_dict(), files))


def share(deployment: str, store: WeightsStore, role: str, version: str,
          durable: "DurableStore | None" = None) -> list[str]:
    """After a trainer published a version into its `store`: a copy into `durable` where that is another place
    (an `s3://` bucket, say), then into the object store when this process is on Ray -> where it went ("durable",
    "object"). A failure of either is logged, not raised: the trainer's store holds the version, and replicas try
    the other source."""
    shared = []
    if durable is not None and not durable.is_store(store):
        try:
            durable.write_version(store, role, version)
            shared.append("durable")
        except WeightsError as exc:
            log.warning("event=durable_publish_failed role=%s version=%s error=%s", role, version, exc)
    if _ray_on():
        try:
            publish_object(deployment, store, role, version)
            shared.append("object")
        except Exception as exc:  # noqa: BLE001 - any Ray error: the durable store still has the version
            log.warning("event=object_publish_failed role=%s version=%s error=%r", role, version, exc)
    return shared


class DurableStore:
    """A weights store read through fsspec (`file:///...`, a plain directory, `s3://bucket/prefix` with s3fs): the
    layout of `WeightsStore`, read only."""

    def __init__(self, url: str):
        import fsspec

        self.url = url.rstrip("/")
        try:
            # its own client: fsspec's instance cache would hand back one made under another endpoint or credentials
            self.fs, self.root = fsspec.core.url_to_fs(self.url, skip_instance_cache=True)
        except (ImportError, ValueError) as exc:  # a protocol fsspec does not know, or its package missing
            raise InvalidRequestError(f"durable store {url!r}: {exc}", param="durable_store") from None

    def is_store(self, store: WeightsStore) -> bool:
        """Whether this URL is `store`'s own directory (nothing to copy)."""
        local = "file" in ((self.fs.protocol,) if isinstance(self.fs.protocol, str) else self.fs.protocol)
        return local and Path(self.root).resolve() == store.root.resolve()

    def write_version(self, store: WeightsStore, role: str, version: str) -> None:
        """Copy a verified version of `store` here: its files, then its manifest. A reader takes a version by its
        manifest, so it never meets one half-copied (and `install` checks every file anyway); one already here is
        kept. Raises WeightsError when the store does not answer."""
        manifest, files = store.read_version(role, version)
        base = f"{self.root}/{role}/{version}"
        try:
            if self.fs.exists(f"{base}/{MANIFEST}"):
                return
            for name, data in files.items():  # a directory needs its parents made; an object store has none
                self.fs.makedirs(f"{base}/{name}".rsplit("/", 1)[0], exist_ok=True)
                self.fs.pipe_file(f"{base}/{name}", data)
            self.fs.pipe_file(f"{base}/{MANIFEST}", json.dumps(manifest.to_dict(), indent=2).encode())
        except Exception as exc:  # noqa: BLE001 - each backend has its own errors (s3fs: botocore's, not OSError)
            raise WeightsError(f"{role} {version}: could not copy it to the durable store {self.url} ({exc})") from None

    def read_version(self, role: str, version: str) -> tuple[Manifest, dict[str, bytes]]:
        base = f"{self.root}/{role}/{version}"
        try:
            manifest = Manifest.from_dict(json.loads(self.fs.cat_file(f"{base}/{MANIFEST}")))
            return manifest, {name: self.fs.cat_file(f"{base}/{name}") for name in manifest.files}
        except FileNotFoundError:
            raise WeightsNotFoundError(f"{role} {version} is not in the durable store {self.url}") from None
        except Exception as exc:  # noqa: BLE001 - each backend has its own errors (s3fs: botocore's, not OSError)
            raise WeightsError(f"{role} {version}: the durable store {self.url} did not answer ({exc})") from None


class Pulls:
    """Counts of pulls by (source, outcome): source local/object/durable; outcome ok, missing, failed, corrupt."""

    def __init__(self):
        self.counts: Counter = Counter()

    def count(self, source: str, outcome: str) -> None:
        self.counts[(source, outcome)] += 1


def pull(store: WeightsStore, role: str, version: str, *, deployment: str, durable: DurableStore | None = None,
         pulls: Pulls | None = None, timeout_s: float = 120.0) -> tuple[Path, str]:
    """-> (the verified version directory in `store`, where it came from: local, object or durable). Raises
    WeightsNotFoundError when no source has it, CorruptWeightsError when the last source's copy did not verify."""
    pulls = pulls or Pulls()
    try:
        directory = store.verify(role, version)
        pulls.count("local", "ok")
        return directory, "local"
    except WeightsNotFoundError:
        pass
    failures, corrupt = [], False
    sources = [("object", lambda: _from_object_store(deployment, role, version, timeout_s))] if _ray_on() else []
    if durable is not None:
        sources.append(("durable", lambda: durable.read_version(role, version)))
    for source, fetch in sources:
        try:
            got = fetch()
            if got is None:
                pulls.count(source, "missing")
                failures.append(f"{source}: not there")
                continue
            directory = store.install(*got)
        except WeightsNotFoundError as exc:
            pulls.count(source, "missing")
            failures.append(f"{source}: {exc}")
            continue
        except CorruptWeightsError as exc:
            pulls.count(source, "corrupt")
            failures.append(f"{source}: {exc}")
            corrupt = True
            log.warning("event=pull_refused role=%s version=%s source=%s error=%s", role, version, source, exc)
            continue
        except WeightsError as exc:
            pulls.count(source, "failed")
            failures.append(f"{source}: {exc}")
            continue
        pulls.count(source, "ok")
        log.info("event=pull role=%s version=%s source=%s", role, version, source)
        return directory, source
    raise (CorruptWeightsError if corrupt else WeightsNotFoundError)(f"{role} {version}: no source could give it ({'; '.join(failures) or 'no source configured'})")


def _ray_on() -> bool:
    """Whether this process is connected to a Ray cluster (the object store is a source only then)."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return False
    import ray

    return ray.is_initialized()


def _from_object_store(deployment: str, role: str, version: str, timeout_s: float):
    """-> (manifest, files) from the registry's object, or None (no registry, not registered). A lost object (its
    node gone) raises WeightsError."""
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    owner = registry(deployment)
    if owner is None:
        return None
    try:
        entry = ray.get(owner.lookup.remote(role, version), timeout=timeout_s)
        if entry is None:
            return None
        manifest, (ref,) = entry
        return Manifest.from_dict(manifest), ray.get(ref, timeout=timeout_s)
    except (GetTimeoutError, RayError) as exc:
        raise WeightsError(f"the object store could not give it ({type(exc).__name__})") from None
