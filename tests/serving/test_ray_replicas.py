"""The server's replicas as one Ray Serve deployment on a local Ray cluster (`specrl up --ray`'s serving part):
two tiny-model replicas behind Serve's proxy and the front answer the official `openai` client, both write records
under their own replica names to the deployment's stream, and a drafter announced as the deployment's `current`
(no replica pushed) reaches both; routed by prefix, every request of a tenant (a long system prompt of its own)
meets the replica that served the tenant first (Serve's default router beside it: tests/bench/test_bench_fleet.py);
without a shared disk, replicas pull versions into their own stores; with --max-replicas, load adds a replica and
its fall removes it, no request failing. Slow: one Ray cluster for the module (~5 s), each deployment ~10 s, a
scale-up and down ~80 s."""

from __future__ import annotations

import importlib.util
import time
import uuid

import pytest
import redis

from specrl.apps.launch import free_port
from specrl.apps.scrape import sample_metrics
from specrl.config import Settings
from specrl.models.drafter import EagleDrafter
from specrl.models.llama import load_llama
from specrl.telemetry import RECORD_FIELD, SegmentRecord, events_stream
from specrl.weights import WeightsStore
from specrl.weights.deployment import DeploymentVersions, control_stream, current_key
from tests.backends import REDIS_URL

pytestmark = [pytest.mark.redis, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the [ray] extra is not installed")]


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def records(deployment: str) -> list[SegmentRecord]:
    entries = redis.Redis.from_url(REDIS_URL).xrange(events_stream(deployment))
    return [SegmentRecord.from_msgpack(fields[RECORD_FIELD.encode()]) for _, fields in entries]


def answering_replicas(client, deployment: str, count: int, wait_s: float = 60.0) -> set[str]:
    """Send requests until `count` replicas wrote records (or `wait_s`) -> the replicas that did."""
    deadline = time.monotonic() + wait_s
    while len(replicas := {r.replica for r in records(deployment)}) < count and time.monotonic() < deadline:
        client.completions.create(model="tiny-random", prompt=f"Hello {uuid.uuid4().hex}", max_tokens=4)
        time.sleep(0.1)  # records leave in batches
    return replicas


def serving_replicas(client, deployment: str, drafter: str, wait_s: float = 60.0) -> set[str]:
    """Send requests until every replica seen so far wrote a record on `drafter` (or `wait_s`) -> those replicas."""
    replicas = {r.replica for r in records(deployment)}
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        client.completions.create(model="tiny-random", prompt="After the swap", max_tokens=4)
        serving = {r.replica for r in records(deployment) if r.drafter_version == drafter}
        if serving == replicas:
            break
        time.sleep(0.2)
    return serving


def pull_counts(url: str, replicas: set[str], pages: int = 40) -> dict[str, dict[tuple[str, str], float]]:
    """Each replica's specrl_weight_pulls_total by (source, outcome), from /metrics pages through the proxy."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    seen: dict[str, dict] = {}
    for _ in range(pages):
        text = httpx.get(url + "/metrics", timeout=30).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        replica = families["specrl_engine_info"].samples[0].labels["replica"]
        pulls = families.get("specrl_weight_pulls")
        seen[replica] = {(s.labels["source"], s.labels["outcome"]): s.value for s in (pulls.samples if pulls else [])
                         if s.name.endswith("_total")}
        if set(seen) == replicas:
            break
    return seen


def test_two_replicas_answer_write_records_and_pull_current_from_the_object_store_then_the_durable_store(
        ray_cluster, home, tmp_path, tiny_dir):
    """Behind Serve's proxy both replicas answer and write records under their own names; a drafter announced as the
    deployment's `current` (no replica pushed) reaches both. The trainer's store is only the durable copy: each
    replica keeps its own store, takes a version shared into the object store from there, and one whose object was
    lost (the registry that owned it killed) from the durable store; both verified."""
    from openai import OpenAI

    from specrl.serving.ray_replicas import run_replicas
    from specrl.weights.object_store import publish_object, registry

    deployment, store = f"test-ray-{uuid.uuid4().hex[:10]}", WeightsStore(tmp_path / "trainer-store")
    settings = Settings.load(home=home, model="tiny-random", redis_url=REDIS_URL, deployment=deployment,
                             store=str(store.root), durable_store=f"file://{store.root}", port=free_port(), threads=1,
                             follow_interval_s=0.5)
    try:
        url = run_replicas(settings, replicas=2)
        client = OpenAI(base_url=url + "/v1", api_key="unused")
        replicas = answering_replicas(client, deployment, 2)
        assert len(replicas) == 2 and all(name.startswith("ray-") for name in replicas)
        assert {r.drafter_version for r in records(deployment)} == {"day0"}
        sample = sample_metrics(url, 0.0)  # one /metrics page names the replica that answered it
        assert sample["replica"] in replicas and sample["drafter"] == "day0" and sample["tokens"] > 0
        versions = DeploymentVersions(store, REDIS_URL, deployment)  # a trainer that knows no replica
        drafter = load_llama(tiny_dir)
        for seed in (11, 12):
            out = tmp_path / f"drafter-{seed}"
            EagleDrafter.day0(drafter, seed=seed).save(out)
            version = store.publish("drafter", out).version
            publish_object(deployment, store, "drafter", version)
            if seed == 12:  # v2's object is lost with its owner (Ray frees what a dead actor owned)
                import ray

                ray.kill(registry(deployment))
            versions.set("drafter", version)
            assert serving_replicas(client, deployment, version) == replicas
        for replica in replicas:  # each replica's own copy, verified
            cache = WeightsStore(home / "weights-cache" / replica)
            assert [m.version for m in cache.versions("drafter")] == ["v1", "v2"]
            assert cache.read_version("drafter", "v2") == store.read_version("drafter", "v2")
        counts = pull_counts(url, replicas)
        assert set(counts) == replicas
        for replica_counts in counts.values():
            assert replica_counts[("object", "ok")] == 1 and replica_counts[("durable", "ok")] == 1
            # v2's registry was gone (or, just killed, still named: its call failed)
            assert replica_counts.get(("object", "missing"), 0) + replica_counts.get(("object", "failed"), 0) == 1
    finally:
        tear_down(deployment)


def tear_down(deployment: str) -> None:
    """Stop the replicas (Ray stays up), the deployment's registry, and delete its keys."""
    from specrl.serving.ray_replicas import stop_replicas
    from specrl.weights.object_store import registry

    stop_replicas(shutdown_ray=False)
    owner = registry(deployment)
    if owner is not None:
        import ray

        ray.kill(owner)
    redis.Redis.from_url(REDIS_URL).delete(events_stream(deployment), current_key(deployment),
                                           control_stream(deployment))


def tenants_replicas(url: str, deployment: str, tenants: int = 4, rounds: int = 3) -> list[set[str]]:
    """Each tenant asks `rounds` questions after its own system prompt (~700 characters: a few of the router's
    blocks), chat and streamed chat in turn -> the replicas that answered each tenant."""
    from openai import OpenAI

    client, answered = OpenAI(base_url=url + "/v1", api_key="unused"), [[] for _ in range(tenants)]
    for r in range(rounds):
        for t in range(tenants):
            messages = [{"role": "system", "content": f"Tenant {t} rules. " * 50},
                        {"role": "user", "content": f"Question {r}?"}]
            if r % 2:
                chunks = list(client.chat.completions.create(model="tiny-random", messages=messages, max_tokens=3,
                                                             stream=True))
                answered[t].append(chunks[0].id)
            else:
                answered[t].append(client.chat.completions.create(model="tiny-random", messages=messages,
                                                                  max_tokens=3).id)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # records leave in batches
        replica_of = {r.request_id: r.replica for r in records(deployment)}
        if all(f"{rid}-0" in replica_of for ids in answered for rid in ids):
            break
        time.sleep(0.2)
    return [{replica_of[f"{rid}-0"] for rid in ids} for ids in answered]


def test_routed_by_prefix_a_tenant_meets_one_replica_and_tenants_spread(ray_cluster, home, tmp_path, tiny_dir):
    from specrl.serving.ray_replicas import run_replicas

    deployment = f"test-ray-{uuid.uuid4().hex[:10]}"
    settings = Settings.load(home=home, model="tiny-random", redis_url=REDIS_URL, deployment=deployment,
                             store=str(tmp_path / "store"), port=free_port(), threads=1, drafter="none")
    try:
        seen = tenants_replicas(run_replicas(settings, replicas=2, router="prefix"), deployment)
    finally:
        tear_down(deployment)
    assert all(len(replicas) == 1 for replicas in seen), seen
    assert len(set.union(*seen)) == 2, seen  # a new prefix goes to the replica owning the fewest


def test_serve_adds_a_replica_under_load_and_removes_it_when_the_load_falls(ray_cluster, home, tmp_path):
    """`--max-replicas`, `--scale-down-after`: one replica, eight clients keeping requests in flight (ongoing
    requests far above the target of 2 a replica); Serve's autoscaler starts a second replica, which takes new
    prompts (routed by prefix, a prompt no replica has served goes to the one holding the fewest) and writes
    records of its own. Then seven clients stop: one request at a time wants one replica, and Serve removes the
    second, draining it, while the last client's requests go on: none fails, before, during or after."""
    import threading

    import httpx
    from ray import serve

    from specrl.serving.ray_replicas import APP_NAME, run_replicas

    deployment = f"test-ray-{uuid.uuid4().hex[:10]}"
    settings = Settings.load(home=home, model="tiny-random", redis_url=REDIS_URL, deployment=deployment,
                             store=str(tmp_path / "store"), port=free_port(), threads=1, drafter="none")
    heavy, light, failures, answered = threading.Event(), threading.Event(), [], []

    def client(url: str, stop: threading.Event) -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                body = {"model": "tiny-random", "prompt": f"Tell me {uuid.uuid4().hex}", "max_tokens": 128}
                response = http.post(url + "/v1/completions", json=body)
                (answered if response.status_code == 200 else failures).append((time.monotonic(), response))

    def running() -> int:
        states = serve.status().applications[APP_NAME].deployments["server"].replica_states
        return states.get("RUNNING", 0)

    try:
        url = run_replicas(settings, replicas=1, max_replicas=2, scale_down_s=2.0)
        clients = [threading.Thread(target=client, args=(url, heavy if i else light), daemon=True) for i in range(8)]
        for thread in clients:
            thread.start()
        deadline = time.monotonic() + 150  # Serve scales up after 30 s above its target, then starts the replica
        while len({r.replica for r in records(deployment)}) < 2 and time.monotonic() < deadline:
            time.sleep(1.0)
        replicas = {r.replica for r in records(deployment)}
        heavy.set()
        # the load's average over Serve's 30 s look-back falls below one replica's target, then 2 s more
        deadline = time.monotonic() + 120
        while running() > 1 and time.monotonic() < deadline:
            time.sleep(1.0)
        scaled_down_at, after = time.monotonic(), running()
        while not any(at > scaled_down_at for at, _ in answered) and time.monotonic() < scaled_down_at + 30:
            time.sleep(0.2)  # the last client is answered by the replica left
        light.set()
        for thread in clients:
            thread.join(timeout=60)
    finally:
        heavy.set()
        light.set()
        tear_down(deployment)
    assert len(replicas) == 2, replicas
    assert after == 1
    assert any(at > scaled_down_at for at, _ in answered)
    assert failures == [], [(r.status_code, r.text[:200]) for _, r in failures]
