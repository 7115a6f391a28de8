"""A replica's process killed mid-swap under locust (issue 46's faults), against real processes on a 2-node
`ray.cluster_utils` cluster (separate raylets and object stores): two tiny-model replicas behind Serve's proxy serve
locust's users; a drafter is announced as the deployment's `current` and one replica's process is SIGKILLed while
the replicas take it, then the same with a policy. Only requests in flight at a kill may fail (counted); every
answer names versions the deployment announced; each killed replica's successor writes its first record on
`current` (it catches up before it takes traffic; the test's own requests with new prompts reach it, as routed by
prefix locust's few prompts stay with the replicas that served them first). Slow: a Ray cluster (~5 s), a deployment (~15 s), locust 45 s."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from specrl.apps.bench.fleet_lifecycle import replica_pids
from specrl.apps.bench.swap_versions import prepare_versions
from specrl.apps.launch import free_port
from specrl.config import Settings
from specrl.loadtest.report import read_jsonl
from specrl.weights import WeightsStore
from specrl.weights.deployment import DeploymentVersions
from specrl.weights.object_store import publish_object
from tests.backends import REDIS_URL, START_VERSIONS
from tests.serving.test_ray_replicas import answering_replicas, records, tear_down

ROOT = Path(__file__).resolve().parents[2]
USERS = 4
LOCUST_SECONDS = 45
pytestmark = [pytest.mark.redis, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the [ray] extra is not installed")]


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def new_replica(client, deployment: str, known: set[str], wait_s: float = 90.0):
    """The first record of a replica not in `known`: waits for one, sending a request with a prompt never seen
    every 0.5 s meanwhile (locust's few prompts keep to the replicas that served them first: routed by prefix, a new
    prefix goes to the replica owning the fewest, the successor) -> that record."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        fresh = [r for r in records(deployment) if r.replica not in known]
        if fresh:
            return fresh[0]
        try:
            client.completions.create(model="tiny-random", prompt=f"A new question {uuid.uuid4().hex}", max_tokens=2)
        except Exception:  # noqa: BLE001 - routed to the killed replica before Serve saw it die: not locust's count
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no new replica wrote a record within {wait_s:g} s")


def test_a_replica_killed_during_a_drafter_swap_and_a_policy_swap_fails_only_its_in_flight_requests(
        two_nodes, home, tmp_path, tiny_dir):
    from openai import OpenAI

    from specrl.serving.ray_replicas import run_replicas

    deployment, store = f"test-ray-faults-{uuid.uuid4().hex[:10]}", WeightsStore(tmp_path / "trainer-store")
    named = prepare_versions(store.root, tiny_dir)
    settings = Settings.load(home=home, model="tiny-random", redis_url=REDIS_URL, deployment=deployment,
                             store=str(store.root), durable_store=str(store.root), port=free_port(), threads=1,
                             follow_interval_s=0.5)
    request_log, locust = tmp_path / "requests.jsonl", None
    swaps = [("drafter", named["drafter"][0]), ("policy", named["policy"][0])]
    kills, successors = [], []
    try:
        url = run_replicas(settings, replicas=2)
        client = OpenAI(base_url=url + "/v1", api_key="unused")
        known = answering_replicas(client, deployment, 2)
        assert len(known) == 2
        locust = subprocess.Popen(
            [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless", "-u",
             str(USERS), "-r", str(USERS), "-t", f"{LOCUST_SECONDS}s", "--stop-timeout", "10", "--host", url,
             "--only-summary"], env={**os.environ, "SPECRL_LOADTEST_LOG": str(request_log)}, cwd=tmp_path,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(5)
        versions = DeploymentVersions(store, REDIS_URL, deployment)
        for role, version in swaps:
            publish_object(deployment, store, role, version)
            versions.set(role, version)
            time.sleep(0.3)  # the replicas' followers look every 0.5 s: this kill lands while they take it
            kills.append(time.time())
            os.kill(replica_pids()[0], signal.SIGKILL)
            successors.append(new_replica(client, deployment, known))
            known |= {r.replica for r in records(deployment)}
        output = locust.communicate(timeout=LOCUST_SECONDS + 120)[0]
    finally:
        if locust is not None and locust.poll() is None:
            locust.kill()
        tear_down(deployment)

    requests = read_jsonl(request_log)
    ok = [r for r in requests if r["status"] == "ok"]
    failed = [r for r in requests if r["status"] not in ("ok", "interrupted")]
    print(f"locust: {len(ok)} ok, {len(failed)} failed, kills at {kills}")
    assert len(ok) >= 40, output[-3000:]
    # the killed replica's in-flight requests at the most: each failed request was running at a kill
    assert all(any(r["start"] <= at <= r["end"] for at in kills) for r in failed), failed
    assert len(failed) <= USERS * len(kills)
    # every answer names a state the deployment announced: start, new drafter, then new policy as well
    drafter, policy = swaps[0][1], swaps[1][1]
    states = {(START_VERSIONS["policy"], START_VERSIONS["drafter"]), (START_VERSIONS["policy"], drafter),
              (policy, drafter)}
    assert {(r["target"], r["drafter"]) for r in ok} <= states
    # a successor takes traffic only once it serves current
    assert (successors[0].target_version, successors[0].drafter_version) == (START_VERSIONS["policy"], drafter)
    assert (successors[1].target_version, successors[1].drafter_version) == (policy, drafter)
