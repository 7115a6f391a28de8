"""The durable store at an `s3://` URL (`DurableStore` through fsspec's s3fs): a replica pulls a version from a real
S3 API over HTTP (moto's S3 server on loopback; credentials and endpoint the AWS way, from the environment),
verifies it against its publisher's manifest before it appears, refuses a tampered object, and an endpoint that
does not answer is a failed source (WeightsError), never an exception of the S3 client reaching the caller."""

from __future__ import annotations

import importlib.util
import uuid

import pytest

from specrl.apps.launch import free_port
from specrl.weights import CorruptWeightsError, WeightsError, WeightsNotFoundError, WeightsStore
from specrl.weights.object_store import DurableStore, Pulls, pull

pytestmark = pytest.mark.skipif(importlib.util.find_spec("s3fs") is None or importlib.util.find_spec("moto") is None,
                                reason="s3fs and moto are in the dev extra")
BUCKET = "specrl-weights"


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server on a loopback port, with a bucket -> its URL."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="test",
                 aws_secret_access_key="test").create_bucket(Bucket=BUCKET)
    yield url
    server.stop()


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    for name, value in (("AWS_ENDPOINT_URL", s3_endpoint), ("AWS_ACCESS_KEY_ID", "test"),
                        ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    return s3_endpoint


@pytest.fixture
def uploaded(s3_env, tmp_path):
    """The trainer's store with drafter v1, copied to a fresh prefix of the bucket as `aws s3 sync` would ->
    (the trainer's store, the durable store's URL, the S3 filesystem)."""
    import fsspec

    store = WeightsStore(tmp_path / "trainer")
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "weights.safetensors").write_bytes(bytes(range(256)) * 64)
    (src / "config.json").write_text('{"hidden_size": 64}')
    store.publish("drafter", src)
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True)
    for path in (store.root / "drafter" / "v1").iterdir():
        fs.pipe_file(f"{root}/drafter/v1/{path.name}", path.read_bytes())
    return store, url, fs


def test_a_replica_pulls_a_version_from_s3_and_verifies_it(uploaded, tmp_path):
    trainer, url, _ = uploaded
    replica, pulls = WeightsStore(tmp_path / "replica"), Pulls()
    durable = DurableStore(url)
    directory, source = pull(replica, "drafter", "v1", deployment="none", durable=durable, pulls=pulls)
    assert source == "durable" and replica.manifest("drafter", "v1") == trainer.manifest("drafter", "v1")
    assert (directory / "weights.safetensors").read_bytes() == bytes(range(256)) * 64
    assert pull(replica, "drafter", "v1", deployment="none", durable=durable, pulls=pulls)[1] == "local"
    with pytest.raises(WeightsNotFoundError, match="not in the durable store s3://"):
        pull(replica, "drafter", "v2", deployment="none", durable=durable, pulls=pulls)
    assert pulls.counts == {("durable", "ok"): 1, ("local", "ok"): 1, ("durable", "missing"): 1}


def test_a_tampered_object_in_s3_never_reaches_the_replicas_store(uploaded, tmp_path):
    _, url, fs = uploaded
    key = f"{url.removeprefix('s3://')}/drafter/v1/weights.safetensors"
    fs.pipe_file(key, fs.cat_file(key)[:-1] + b"\x00")
    replica, pulls = WeightsStore(tmp_path / "replica"), Pulls()
    with pytest.raises(CorruptWeightsError, match="sha256"):
        pull(replica, "drafter", "v1", deployment="none", durable=DurableStore(url), pulls=pulls)
    assert replica.versions("drafter") == [] and pulls.counts == {("durable", "corrupt"): 1}


def test_an_s3_endpoint_that_does_not_answer_is_a_failed_source(s3_env, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    durable, pulls = DurableStore(f"s3://{BUCKET}/elsewhere"), Pulls()
    with pytest.raises(WeightsNotFoundError, match="the durable store s3://.* did not answer"):
        pull(WeightsStore(tmp_path / "replica"), "drafter", "v1", deployment="none", durable=durable, pulls=pulls)
    assert pulls.counts == {("durable", "failed"): 1}
    with pytest.raises(WeightsError, match="did not answer"):
        durable.read_version("drafter", "v1")


def test_a_trainer_copies_each_version_it_publishes_to_s3_where_a_replica_pulls_it(s3_env, tmp_path):
    """`share` after a publish (what the drafter trainer's publisher and the Ray policy trainer call): files first,
    the manifest last; a version already there is kept; the trainer's own store is never copied onto itself."""
    import fsspec

    from specrl.weights.object_store import share

    trainer = WeightsStore(tmp_path / "trainer")
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "weights.safetensors").write_bytes(b"\x01" * 4096)
    (src / "sub" / "config.json").write_text('{"hidden_size": 64}')
    trainer.publish("policy", src)
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    assert share("none", trainer, "policy", "v1", DurableStore(url)) == ["durable"]
    fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True)
    assert sorted(fs.find(root)) == sorted(f"{root}/policy/v1/{name}"
                                           for name in ("manifest.json", "weights.safetensors", "sub/config.json"))
    replica = WeightsStore(tmp_path / "replica")
    directory, source = pull(replica, "policy", "v1", deployment="none", durable=DurableStore(url))
    assert source == "durable" and (directory / "sub" / "config.json").read_text() == '{"hidden_size": 64}'
    fs.pipe_file(f"{root}/policy/v1/weights.safetensors", b"other")
    assert share("none", trainer, "policy", "v1", DurableStore(url)) == ["durable"]  # there already: kept
    assert fs.cat_file(f"{root}/policy/v1/weights.safetensors") == b"other"
    assert share("none", trainer, "policy", "v1", DurableStore(str(trainer.root))) == []  # its own store
    assert share("none", trainer, "policy", "v1", DurableStore(f"file://{trainer.root}")) == []
    local = tmp_path / "mirror"
    assert share("none", trainer, "policy", "v1", DurableStore(f"file://{local}")) == ["durable"]
    assert WeightsStore(local).verify("policy", "v1") == local / "policy" / "v1"


def test_a_durable_store_that_does_not_answer_never_fails_the_publish(s3_env, monkeypatch, tmp_path, caplog):
    from specrl.weights.object_store import share

    trainer = WeightsStore(tmp_path / "trainer")
    trainer.publish_tensors("drafter", {}, {"hidden_size": 8})
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with caplog.at_level("WARNING", logger="specrl.weights"):
        assert share("none", trainer, "drafter", "v1", DurableStore(f"s3://{BUCKET}/down")) == []
    assert any("event=durable_publish_failed" in r.getMessage() and "could not copy" in r.getMessage()
               for r in caplog.records)
