"""The weights store on real files in tmp_path: publish, pointers, verify, names, races, failures."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from specrl.errors import SpecrlError
from specrl.weights import (
    CorruptWeightsError,
    Manifest,
    WeightsConflictError,
    WeightsError,
    WeightsNameError,
    WeightsNotFoundError,
    WeightsStore,
)


@pytest.fixture
def store(tmp_path):
    return WeightsStore(tmp_path / "weights")


@pytest.fixture
def checkpoint(tmp_path):
    """A source directory as a trainer would write it."""
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "weights.safetensors").write_bytes(bytes(range(256)) * 40)
    (src / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (src / "sub" / "extra.json").write_text("{}")
    return src


def test_publish_list_current_and_parent_chain(store, checkpoint):
    assert store.versions("drafter") == [] and store.current("drafter") is None
    first = store.publish("drafter", checkpoint, target_version="p1", metrics={"acceptance": 0.4},
                          architecture={"hidden_size": 64})
    second = store.publish("drafter", checkpoint, parent=first.version, make_current=True)
    third = store.publish("drafter", checkpoint, parent=second.version)

    assert [m.version for m in store.versions("drafter")] == ["v1", "v2", "v3"]
    assert store.current("drafter") == "v2"
    store.set_current("drafter", "v3")
    assert store.current("drafter") == "v3"
    assert [store.parent("drafter", v) for v in ("v1", "v2", "v3")] == [None, "v1", "v2"]

    m = store.manifest("drafter", "v1")
    assert m == first and m.role == "drafter" and m.target_version == "p1"
    assert m.metrics == {"acceptance": 0.4} and m.architecture == {"hidden_size": 64}
    assert set(m.files) == {"weights.safetensors", "config.json", "sub/extra.json"}
    assert m.files["weights.safetensors"]["bytes"] == 256 * 40
    assert m.created.endswith("Z") and Manifest.from_dict(m.to_dict()) == m
    assert third.parent == "v2"
    assert store.versions("policy") == []  # roles are separate


def test_versions_auto_increment_and_explicit_names(store, checkpoint):
    assert store.publish("policy", checkpoint, version="v9").version == "v9"
    assert store.publish("policy", checkpoint).version == "v10"
    assert store.publish("policy", checkpoint, version="base-0.1").version == "base-0.1"
    assert store.publish("policy", checkpoint).version == "v11"
    with pytest.raises(WeightsConflictError, match="already exists"):
        store.publish("policy", checkpoint, version="v10")
    listed = [m.version for m in store.versions("policy")]  # by creation second, then v9 < v10 < v11
    assert sorted(listed) == sorted(["v9", "v10", "v11", "base-0.1"])
    assert [v for v in listed if v.startswith("v")] == ["v9", "v10", "v11"]


def test_publish_tensors_roundtrip(store):
    tensors = {"fc.weight": torch.randn(4, 8).t(), "norm.weight": torch.ones(8, dtype=torch.float16)}
    m = store.publish_tensors("drafter", tensors, {"hidden_size": 8}, make_current=True)
    directory = store.verify("drafter", store.current("drafter"))
    loaded = load_file(directory / "weights.safetensors")
    assert set(m.files) == {"weights.safetensors", "config.json"}
    assert torch.equal(loaded["fc.weight"], tensors["fc.weight"]) and loaded["norm.weight"].dtype == torch.float16
    assert json.loads((directory / "config.json").read_text()) == {"hidden_size": 8}


def test_pointer_is_atomic_under_concurrent_readers(store, checkpoint):
    names = {store.publish("drafter", checkpoint).version for _ in range(3)}
    store.set_current("drafter", "v1")
    seen, stop = set(), threading.Event()

    def read():
        while not stop.is_set():
            seen.add(store.current("drafter"))

    readers = [threading.Thread(target=read) for _ in range(4)]
    for t in readers:
        t.start()
    for i in range(300):
        store.set_current("drafter", f"v{i % 3 + 1}")
    stop.set()
    for t in readers:
        t.join()
    assert seen and seen <= names
    assert [p.name for p in store.root.joinpath("drafter").iterdir() if p.name.startswith(".")] == []


def test_set_current_needs_an_existing_version(store, checkpoint):
    store.publish("drafter", checkpoint)
    with pytest.raises(WeightsNotFoundError, match=r"drafter v7 is not in the store .*it has: v1"):
        store.set_current("drafter", "v7")
    assert store.current("drafter") is None


def test_verify_passes_on_an_intact_version(store, checkpoint):
    store.publish("drafter", checkpoint)
    assert store.verify("drafter", "v1") == store.root / "drafter" / "v1"


@pytest.mark.parametrize("damage, message", [
    ("flip", "weights.safetensors has the wrong sha256 (corrupt or modified checkpoint)"),
    ("truncate", "weights.safetensors has 10239 bytes, the manifest says 10240"),
    ("delete", "weights.safetensors is missing"),
])
def test_verify_catches_damaged_files(store, checkpoint, damage, message):
    directory = store.verify("drafter", store.publish("drafter", checkpoint).version)
    path = directory / "weights.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[100] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-1]))
    else:
        path.unlink()
    with pytest.raises(CorruptWeightsError) as err:
        store.verify("drafter", "v1")
    assert err.value.message.startswith("drafter v1: ") and message in err.value.message
    assert err.value.http_status == 409 and isinstance(err.value, SpecrlError)


def test_verify_catches_a_manifest_of_another_role(store, checkpoint):
    directory = store.verify("drafter", store.publish("drafter", checkpoint).version)
    record = json.loads((directory / "manifest.json").read_text())
    (directory / "manifest.json").write_text(json.dumps({**record, "role": "policy"}))
    with pytest.raises(CorruptWeightsError, match="manifest.json is for policy v1"):
        store.verify("drafter", "v1")


def test_verify_catches_an_unreadable_manifest(store, checkpoint):
    store.publish("drafter", checkpoint)
    (store.root / "drafter" / "v1" / "manifest.json").write_text("{not json")
    with pytest.raises(CorruptWeightsError, match="unreadable"):
        store.verify("drafter", "v1")


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".hidden", "v1/../../etc", "..", "current", "v1\n",
                                  "/etc/passwd", "x" * 65, None])
def test_unsafe_version_names_are_refused(store, checkpoint, name):
    store.publish("drafter", checkpoint)
    for call in (store.verify, store.manifest, store.set_current, store.parent):
        with pytest.raises(WeightsNameError, match="invalid version name"):
            call("drafter", name)
    if name is not None:  # None means "automatic" / "no parent" there
        with pytest.raises(WeightsNameError):
            store.publish("drafter", checkpoint, version=name)
        with pytest.raises(WeightsNameError):
            store.publish("drafter", checkpoint, parent=name)
    assert [m.version for m in store.versions("drafter")] == ["v1"]


@pytest.mark.parametrize("role", ["target", "../drafter", "", "Drafter"])
def test_unknown_roles_are_refused(store, checkpoint, role):
    for call in (lambda: store.publish(role, checkpoint), lambda: store.versions(role),
                 lambda: store.current(role), lambda: store.verify(role, "v1")):
        with pytest.raises(WeightsNameError, match="unknown role .* use one of drafter, policy"):
            call()
    assert not store.root.exists()


def test_unknown_version_is_not_found(store):
    with pytest.raises(WeightsNotFoundError, match=r"policy v1 is not in the store .*it has: none") as err:
        store.verify("policy", "v1")
    assert err.value.http_status == 404


def test_publishing_a_missing_or_empty_directory_is_refused(store, tmp_path):
    with pytest.raises(WeightsNotFoundError, match="does not exist"):
        store.publish("drafter", tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="no files"):
        store.publish("drafter", tmp_path / "empty")
    assert store.versions("drafter") == [] and list((store.root / "drafter").iterdir()) == []


def test_concurrent_publishers_get_distinct_versions(store, checkpoint):
    results, barrier = [], threading.Barrier(8)

    def publish():
        barrier.wait()
        for _ in range(3):
            results.append(store.publish("drafter", checkpoint).version)

    threads = [threading.Thread(target=publish) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results, key=lambda v: int(v[1:])) == [f"v{i}" for i in range(1, 25)]
    for version in results:
        assert store.verify("drafter", version) and store.manifest("drafter", version).version == version


def test_interrupted_publish_leaves_nothing_behind(store, checkpoint):
    store.publish("drafter", checkpoint)
    (checkpoint / "weights.safetensors").rename(checkpoint / "moved")
    (checkpoint / "weights.safetensors").symlink_to(checkpoint / "gone")  # unreadable source file
    with pytest.raises(WeightsError, match="copy failed"):
        store.publish("drafter", checkpoint, make_current=True)
    with pytest.raises(AttributeError):  # a failure inside publish_tensors' writer
        store.publish_tensors("drafter", {"w": "not a tensor"}, {})
    assert sorted(p.name for p in (store.root / "drafter").iterdir()) == ["v1"]
    assert [m.version for m in store.versions("drafter")] == ["v1"] and store.current("drafter") is None
    assert store.publish("drafter", checkpoint.parent / "ckpt" / "sub").version == "v2"


def test_what_a_crashed_publisher_left_is_swept_once_stale_and_a_publish_in_flight_is_kept(store, checkpoint):
    store.publish("policy", checkpoint, make_current=True)
    role_dir = store.root / "policy"
    crashed = role_dir / ".publish-deadbeef00000000"           # a publisher killed mid-copy, hours ago
    (crashed / "sub").mkdir(parents=True)
    (crashed / "model.safetensors").write_bytes(b"half")
    pointer = role_dir / ".current-0123456789abcdef"           # a pointer writer killed before its rename
    pointer.write_text("v1\n")
    in_flight = role_dir / ".install-feedface00000000"         # another process's install, just begun
    in_flight.mkdir()
    hours_ago = time.time() - 2 * 3600
    for path in (crashed, pointer):
        os.utime(path, (hours_ago, hours_ago))
    assert store.publish("policy", checkpoint).version == "v2"  # a publish sweeps the stale ones first
    assert sorted(p.name for p in role_dir.iterdir()) == [".install-feedface00000000", "current", "v1", "v2"]
    assert store.current("policy") == "v1" and store.sweep_staging("policy") == []
    assert store.sweep_staging("policy", older_than_s=-1) == [".install-feedface00000000"]
    assert store.sweep_staging("drafter") == []                 # a role never published: nothing to read
    for version in ("v1", "v2"):
        store.verify("policy", version)
