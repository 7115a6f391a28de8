"""Versioned checkpoint store on disk: the trainer publishes, servers load, verify and swap.

Layout::

    <root>/<role>/<version>/    checkpoint files (safetensors + json configs) and manifest.json
    <root>/<role>/current       one line: the version servers should run

A version directory only ever appears by renaming a finished staging directory
(`<root>/<role>/.publish-*`) into place, so readers see no version or a whole one, and
two racing publishers never get the same version (the loser's rename fails, it takes the
next number). The pointer is replaced with `os.replace`, so it always names a whole
version. A crash can leave a hidden staging directory behind: ignored by readers, and removed by the
next publish or install of that role once it is STALE_STAGING_S old (a live publisher's staging is
younger: a publish takes seconds); a power loss can leave a version whose file contents never reached
the disk, which `verify` catches.

Every name that becomes part of a path is checked first: roles are `ROLES`, versions
match `VERSION_PATTERN`, so no name can climb out of the store.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

from specrl.assets import MANIFEST, sha256_file, write_manifest
from specrl.errors import (CorruptWeightsError, WeightsConflictError, WeightsError, WeightsNameError,
                           WeightsNotFoundError)

ROLES = ("drafter", "policy")
VERSION_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # used with fullmatch
POINTER = "current"
WEIGHTS_FILE = "weights.safetensors"
CONFIG_FILE = "config.json"
_AUTO_VERSION = re.compile(r"v([0-9]+)")
STAGING_PREFIXES = (".publish-", ".install-", ".current-")
STALE_STAGING_S = 3600.0


@dataclass(frozen=True)
class Manifest:
    """What `<root>/<role>/<version>/manifest.json` says about one version."""

    role: str
    version: str
    created: str  # UTC, ISO 8601: "2025-01-31T12:00:00Z"
    files: dict  # relative file name -> {"sha256": hex digest, "bytes": size}
    parent: str | None = None  # the version this one was trained from
    target_version: str | None = None  # the policy version a drafter was trained against
    metrics: dict = field(default_factory=dict)  # e.g. held-out acceptance rate
    architecture: dict = field(default_factory=dict)  # what a loader checks before a swap

    @classmethod
    def from_dict(cls, data: dict) -> Manifest:
        """Parse a manifest.json object; ValueError when it lacks a field or a file entry is malformed."""
        missing = [name for name in ("role", "version", "created", "files") if name not in data]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        for name, meta in data["files"].items():
            if not (isinstance(meta, dict) and isinstance(meta.get("sha256"), str)
                    and isinstance(meta.get("bytes"), int)):
                raise ValueError(f"entry for {name!r} needs sha256 and bytes")
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    def to_dict(self) -> dict:
        return asdict(self)


class WeightsStore:
    """Versioned checkpoints under `root`, shared by trainers and server replicas.

    The store holds no state but `root`: every answer is read from disk, so any number of
    threads and processes may read while others publish.
    """

    def __init__(self, root: Path | str):
        self.root = Path(root)

    # ---- publish ---------------------------------------------------------------------------

    def publish(self, role: str, source_dir: Path | str, *, parent: str | None = None,
                target_version: str | None = None, metrics: dict | None = None,
                architecture: dict | None = None, version: str | None = None,
                make_current: bool = False) -> Manifest:
        """Copy every file under `source_dir` (a `manifest.json` there is ignored) into a new version.

        `version` defaults to the next free "v<N>" of the role; an explicit name that is taken
        raises WeightsConflictError. `parent` and `target_version` are version names (checked
        for form, not looked up: a parent may be a base model outside the store).
        """
        self._role_dir(role)
        source = Path(source_dir)
        if not source.is_dir():
            raise WeightsNotFoundError(f"cannot publish {role}: source directory {source} does not exist")

        def fill(staging: Path) -> None:
            try:
                shutil.copytree(source, staging, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MANIFEST))
            except OSError as exc:  # shutil.Error included
                raise WeightsError(f"cannot publish {role} from {source}: copy failed ({exc})") from exc

        return self._publish(role, fill, parent=parent, target_version=target_version, metrics=metrics,
                             architecture=architecture, version=version, make_current=make_current)

    def publish_tensors(self, role: str, tensors: dict, config: dict, **options) -> Manifest:
        """Publish `tensors` as `weights.safetensors` and `config` as `config.json`.

        tensors: name -> torch.Tensor, any shape and dtype (copied to CPU, made contiguous;
        two names may not share memory, as safetensors requires). `options`: the keyword
        options of `publish` (parent, target_version, metrics, architecture, version, make_current).
        """
        from safetensors.torch import save_file

        def fill(staging: Path) -> None:
            cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
            save_file(cpu, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
            (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2))

        return self._publish(role, fill, **options)

    def _publish(self, role: str, fill: Callable[[Path], None], *, parent: str | None = None,
                 target_version: str | None = None, metrics: dict | None = None,
                 architecture: dict | None = None, version: str | None = None,
                 make_current: bool = False) -> Manifest:
        """Stage files with `fill`, hash them into the manifest, rename into place; nothing is left on failure."""
        role_dir = self._role_dir(role)
        for param, name in (("version", version), ("parent", parent), ("target_version", target_version)):
            if name is not None:
                self._check_version(name, param)
        role_dir.mkdir(parents=True, exist_ok=True)
        self.sweep_staging(role)
        staging = role_dir / f".publish-{secrets.token_hex(8)}"
        staging.mkdir()
        try:
            fill(staging)
            if not any(p.is_file() for p in staging.rglob("*")):
                raise WeightsError(f"cannot publish {role}: there are no files to publish")
            record = write_manifest(staging, {
                "role": role, "version": version, "parent": parent, "target_version": target_version,
                "metrics": dict(metrics or {}), "architecture": dict(architecture or {}),
            })
            self._rename_into_place(role, staging, record, version)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone already when the rename succeeded
        if make_current:
            self.set_current(role, record["version"])
        return Manifest.from_dict(record)

    def _rename_into_place(self, role: str, staging: Path, record: dict, version: str | None) -> None:
        """Rename `staging` to its version directory; an automatic name that is taken moves to the next number."""
        role_dir = self._role_dir(role)
        tried = 0
        while True:
            if version is None:
                tried = max([tried, *self._auto_numbers(role)]) + 1
            record["version"] = version or f"v{tried}"
            (staging / MANIFEST).write_text(json.dumps(record, indent=2))
            try:
                os.rename(staging, role_dir / record["version"])  # fails when the target holds files
                return
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                if version is not None:
                    raise WeightsConflictError(
                        f"{role} {version} already exists: publish under another version name") from None

    def sweep_staging(self, role: str, older_than_s: float = STALE_STAGING_S) -> list[str]:
        """Remove what a crashed publisher, installer or pointer writer left in the role's directory (hidden
        `.publish-*`, `.install-*` directories, `.current-*` files) last modified more than `older_than_s` ago
        -> their names. Younger ones may belong to a publish in flight in another process and are kept."""
        role_dir = self._role_dir(role)
        if not role_dir.is_dir():
            return []
        cutoff, removed = time.time() - older_than_s, []
        for entry in role_dir.iterdir():
            if not entry.name.startswith(STAGING_PREFIXES):
                continue
            try:
                if entry.lstat().st_mtime >= cutoff:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
            except FileNotFoundError:  # another process swept or renamed it first
                continue
            removed.append(entry.name)
        return removed

    def _auto_numbers(self, role: str) -> list[int]:
        return [int(m.group(1)) for name in os.listdir(self._role_dir(role)) if (m := _AUTO_VERSION.fullmatch(name))]

    def _names(self, role: str) -> list[str]:
        """Names of the published versions of `role` (v2 before v10); staging dirs are hidden, never listed."""
        role_dir = self._role_dir(role)
        if not role_dir.is_dir():
            return []
        names = [p.name for p in role_dir.iterdir() if VERSION_PATTERN.fullmatch(p.name) and (p / MANIFEST).is_file()]
        return sorted(names, key=_natural)

    def install(self, manifest: Manifest, files: dict[str, bytes]) -> Path:
        """Write a version published elsewhere (another store, Ray's object store) under its own name and manifest
        -> its directory. The files are checked against the publisher's manifest (names, bytes, sha256) before the
        staging directory is renamed into place, so a corrupt copy never appears in the store
        (CorruptWeightsError). A version already here is verified and kept."""
        role_dir = self._role_dir(manifest.role)
        self._check_version(manifest.version)
        if (role_dir / manifest.version / MANIFEST).is_file():
            return self.verify(manifest.role, manifest.version)
        if set(files) != set(manifest.files):
            raise CorruptWeightsError(f"{manifest.role} {manifest.version}: the copy has files "
                                      f"{sorted(files)}, the manifest lists {sorted(manifest.files)}")
        role_dir.mkdir(parents=True, exist_ok=True)
        self.sweep_staging(manifest.role)
        staging = role_dir / f".install-{secrets.token_hex(8)}"
        staging.mkdir()
        try:
            for name, data in files.items():
                relative = Path(name)
                if relative.is_absolute() or ".." in relative.parts:
                    raise CorruptWeightsError(f"{manifest.role} {manifest.version}: {name!r} points outside the "
                                              "version directory")
                (staging / relative).parent.mkdir(parents=True, exist_ok=True)
                (staging / relative).write_bytes(data)
            problems = [p for name, meta in sorted(manifest.files.items()) if (p := _check_file(staging, name, meta))]
            if problems:
                raise CorruptWeightsError(f"{manifest.role} {manifest.version}: " + "; ".join(problems))
            (staging / MANIFEST).write_text(json.dumps(manifest.to_dict(), indent=2))
            try:
                os.rename(staging, role_dir / manifest.version)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise  # another installer won the race: its copy was checked the same way
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return self._version_dir(manifest.role, manifest.version)

    def read_version(self, role: str, version: str) -> tuple[Manifest, dict[str, bytes]]:
        """A verified version's manifest and file contents, to send to another store (`install`)."""
        directory = self.verify(role, version)
        manifest = self.manifest(role, version)
        return manifest, {name: (directory / name).read_bytes() for name in manifest.files}

    # ---- read ------------------------------------------------------------------------------

    def versions(self, role: str) -> list[Manifest]:
        """Every published version of `role`, oldest first (by creation time, then v2 < v10)."""
        manifests = (self.manifest(role, name) for name in self._names(role))
        return sorted(manifests, key=lambda m: (m.created, _natural(m.version)))

    def manifest(self, role: str, version: str) -> Manifest:
        """The manifest of one version (not verified against the files: see `verify`)."""
        path = self._version_dir(role, version) / MANIFEST
        try:
            return Manifest.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            have = ", ".join(self._names(role)) or "none"
            raise WeightsNotFoundError(
                f"{role} {version} is not in the store at {self.root} (it has: {have})") from None
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise CorruptWeightsError(
                f"{role} {version}: {path} is unreadable ({exc}); republish this version") from None

    def parent(self, role: str, version: str) -> str | None:
        """The version `version` was trained from (None for a first version)."""
        return self.manifest(role, version).parent

    def current(self, role: str) -> str | None:
        """The version the `current` pointer names, or None when none was set."""
        path = self._role_dir(role) / POINTER
        try:
            name = path.read_text().strip()
        except FileNotFoundError:
            return None
        if not VERSION_PATTERN.fullmatch(name):
            raise CorruptWeightsError(f"{path} holds {name[:80]!r}, not a version name: run set_current again")
        return name

    def set_current(self, role: str, version: str) -> None:
        """Point `<root>/<role>/current` at `version`, which must exist; readers see the old or the new name."""
        self.manifest(role, version)
        role_dir = self._role_dir(role)
        tmp = role_dir / f".current-{secrets.token_hex(8)}"
        try:
            with open(tmp, "x") as fh:
                fh.write(version + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, role_dir / POINTER)
        finally:
            tmp.unlink(missing_ok=True)

    def verify(self, role: str, version: str) -> Path:
        """Re-hash every file against the manifest and check its role; return the version directory.

        Raises WeightsNameError (bad role or name), WeightsNotFoundError (no such version) or
        CorruptWeightsError naming every file that is missing, truncated or modified.
        """
        manifest = self.manifest(role, version)
        directory = self._version_dir(role, version)
        label = f"{role} {version}"
        if (manifest.role, manifest.version) != (role, version):
            raise CorruptWeightsError(f"{label}: manifest.json is for {manifest.role} {manifest.version} "
                                      "(a checkpoint copied into the wrong place?)")
        if not manifest.files:
            raise CorruptWeightsError(f"{label}: manifest.json lists no files")
        problems = [p for name, meta in sorted(manifest.files.items()) if (p := _check_file(directory, name, meta))]
        if problems:
            raise CorruptWeightsError(f"{label}: " + "; ".join(problems))
        return directory

    # ---- names -> paths (the only places a path is built from a name) ---------------------

    def _role_dir(self, role: str) -> Path:
        if role not in ROLES:
            raise WeightsNameError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
        return self.root / role

    def _version_dir(self, role: str, version: str) -> Path:
        return self._role_dir(role) / self._check_version(version)

    @staticmethod
    def _check_version(version: str, param: str = "version") -> str:
        if not isinstance(version, str) or not VERSION_PATTERN.fullmatch(version) or version == POINTER:
            raise WeightsNameError(f"invalid version name {version!r}: use 1-64 letters, digits, '.', '_' or '-', "
                                   f"starting with a letter or digit (and not {POINTER!r})", param=param)
        return version


def _check_file(directory: Path, name: str, meta: dict) -> str | None:
    """What is wrong with one file of a version, or None when it matches the manifest."""
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        return f"{name!r} points outside the version directory"
    path = directory / relative
    if not path.is_file():
        return f"{name} is missing"
    size = path.stat().st_size
    if size != meta["bytes"]:
        return f"{name} has {size} bytes, the manifest says {meta['bytes']} (truncated or modified checkpoint)"
    if sha256_file(path) != meta["sha256"]:
        return f"{name} has the wrong sha256 (corrupt or modified checkpoint)"
    return None


def _natural(name: str) -> list:
    """Sort key that orders v2 before v10: ["v", 2, ""]."""
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"([0-9]+)", name))]
