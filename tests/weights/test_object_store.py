"""Weights without a shared disk (`specrl.weights.object_store`, `WeightsStore.install`): a version copied into
another store is checked against its publisher's manifest before it appears; a replica's pull takes its own store,
then Ray's object store (the registry owns the object, so it outlives its publisher), then the durable store
(file:// through fsspec); a copy that does not verify never lands, and every try is counted."""

from __future__ import annotations

import dataclasses
import importlib.util
import uuid

import pytest

from specrl.errors import InvalidRequestError
from specrl.weights import CorruptWeightsError, WeightsNotFoundError, WeightsStore
from specrl.weights.object_store import DurableStore, Pulls, pull


@pytest.fixture
def published(tmp_path):
    """The trainer's store with drafter v1 (two files, one in a subdirectory)."""
    store = WeightsStore(tmp_path / "trainer")
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "weights.safetensors").write_bytes(bytes(range(256)) * 64)
    (src / "sub" / "config.json").write_text('{"hidden_size": 64}')
    store.publish("drafter", src)
    return store


def test_install_checks_the_copy_before_it_appears(published, tmp_path):
    manifest, files = published.read_version("drafter", "v1")
    replica = WeightsStore(tmp_path / "replica")
    tampered = {**files, "weights.safetensors": files["weights.safetensors"][:-1] + b"\x00"}
    with pytest.raises(CorruptWeightsError, match="sha256"):
        replica.install(manifest, tampered)
    with pytest.raises(CorruptWeightsError, match="lists"):
        replica.install(manifest, {"weights.safetensors": files["weights.safetensors"]})
    escaping = dataclasses.replace(manifest, files={"../x": manifest.files["weights.safetensors"]})
    with pytest.raises(CorruptWeightsError, match="outside"):
        replica.install(escaping, {"../x": files["weights.safetensors"]})
    assert replica.versions("drafter") == [] and not (tmp_path / "x").exists()  # nothing half-written
    directory = replica.install(manifest, files)
    assert replica.verify("drafter", "v1") == directory and replica.manifest("drafter", "v1") == manifest
    assert replica.install(manifest, files) == directory  # already here: verified, kept


def test_a_pull_takes_the_durable_store_and_counts_what_it_tried(published, tmp_path):
    replica, pulls = WeightsStore(tmp_path / "replica"), Pulls()
    durable = DurableStore(f"file://{published.root}")
    assert pull(replica, "drafter", "v1", deployment="none", durable=durable, pulls=pulls)[1] == "durable"
    assert pull(replica, "drafter", "v1", deployment="none", durable=durable, pulls=pulls)[1] == "local"
    with pytest.raises(WeightsNotFoundError, match="durable"):
        pull(replica, "drafter", "v9", deployment="none", durable=durable, pulls=pulls)
    assert pulls.counts == {("durable", "ok"): 1, ("local", "ok"): 1, ("durable", "missing"): 1}
    with pytest.raises(WeightsNotFoundError, match="no source"):
        pull(WeightsStore(tmp_path / "other"), "drafter", "v1", deployment="none")


def test_a_durable_store_url_fsspec_cannot_open_is_one_clear_error(tmp_path):
    with pytest.raises(InvalidRequestError, match="durable store 'nosuchproto://bucket/x'"):
        DurableStore("nosuchproto://bucket/x")
    with pytest.raises(WeightsNotFoundError, match="not in the durable store"):
        DurableStore(str(tmp_path / "empty")).read_version("drafter", "v1")


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the [ray] extra is not installed")
def test_the_object_outlives_its_publisher_and_a_bad_or_lost_one_falls_back(ray_cluster, published, tmp_path):
    import ray

    from specrl.weights.object_store import registry

    class Trainer:
        """A publisher in a process of its own, killed after it published (defined here: pickled by value)."""

        def publish(self, deployment: str, root: str, version: str) -> None:
            from specrl.weights.object_store import publish_object

            publish_object(deployment, WeightsStore(root), "drafter", version)

    deployment = f"test-{uuid.uuid4().hex[:8]}"
    trainer = ray.remote(num_cpus=0)(Trainer).remote()
    ray.get(trainer.publish.remote(deployment, str(published.root), "v1"))
    ray.kill(trainer)  # the publisher is gone; the registry owns the object
    pulls = Pulls()
    try:
        replica = WeightsStore(tmp_path / "replica-a")
        assert pull(replica, "drafter", "v1", deployment=deployment, pulls=pulls)[1] == "object"
        assert replica.read_version("drafter", "v1") == published.read_version("drafter", "v1")

        # a registered copy that does not match its manifest: refused, counted, the durable copy taken
        manifest, files = published.read_version("drafter", "v1")
        owner = registry(deployment)
        bad = {**files, "weights.safetensors": b"\x00" * len(files["weights.safetensors"])}
        ray.get(owner.register.remote("drafter", "v1", manifest.to_dict(), bad))
        durable = DurableStore(str(published.root))  # a plain directory works too
        replica_b = WeightsStore(tmp_path / "replica-b")
        assert pull(replica_b, "drafter", "v1", deployment=deployment, durable=durable, pulls=pulls)[1] == "durable"
        with pytest.raises(CorruptWeightsError, match="sha256"):
            pull(WeightsStore(tmp_path / "replica-c"), "drafter", "v1", deployment=deployment, pulls=pulls)

        # the registry's object lost: the durable store
        assert ray.get(owner.forget.remote("drafter", "v1"))
        replica_d = WeightsStore(tmp_path / "replica-d")
        assert pull(replica_d, "drafter", "v1", deployment=deployment, durable=durable, pulls=pulls)[1] == "durable"
        assert pulls.counts == {("object", "ok"): 1, ("object", "corrupt"): 2, ("durable", "ok"): 2,
                                ("object", "missing"): 1}
    finally:
        owner = registry(deployment)
        if owner is not None:
            ray.kill(owner)
