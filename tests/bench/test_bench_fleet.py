"""`specrl bench fleet` on the tiny model, two replicas on one local Ray node: both routers run on fresh replicas,
routed by prefix every counted turn reuses its tenant's system prompt, the report and the chart; bad flags get one
line. Slow: two Serve deployments (~25 s each)."""

import importlib.util
import json
import subprocess
import sys

import matplotlib.image
import pytest

from specrl.apps.launch import free_port
from specrl.config import Settings

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the [ray] extra is not installed")]


def test_bench_fleet_tiny(home, tmp_path, capsys, tiny_dir):
    from specrl.apps.bench.fleet import run_fleet_bench

    settings = Settings.load(home=home, model="tiny-random", threads=1, drafter="none", port=free_port())
    result = run_fleet_bench(settings, replicas=2, nodes=1, tenants=4, rounds=2, users=2, repeats=1,
                             out_dir=str(tmp_path))

    report = json.loads((tmp_path / "bench-fleet.json").read_text())
    assert report["machine"]["read_gb_s"] > 0 and report["tenants"] == 4 and report["system_tokens"] == 1000
    runs = {run["router"]: run for run in report["runs"]}
    assert set(runs) == {"prefix", "pow2"}
    for run in runs.values():
        assert len(run["ttft_ms"]["values"]) == 4  # the second round only
        assert run["prefix_cache_queries"] >= 4 * 1000  # summed over both replicas
    prefix = runs["prefix"]
    assert prefix["prefix_cache_hits"] >= 4 * 1000  # every turn met its tenant's prompt
    assert result["ttft_p50_prefix_over_pow2"] == report["ttft_p50_prefix_over_pow2"] > 0
    png = tmp_path / "bench-fleet.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE and min(matplotlib.image.imread(png).shape[:2]) > 100
    out = capsys.readouterr().out
    assert "TTFT p50, prefix over pow2" in out and str(tmp_path / "bench-fleet.json") in out


def test_bench_fleet_bad_flags_get_one_line(tmp_path):
    for flags, message in ((["--rounds", "1"], "--rounds must be at least 2"),
                           (["--replicas", "0"], "--replicas must be at least 1"),
                           (["--minutes", "0"], "--minutes must be > 0")):
        done = subprocess.run([sys.executable, "-m", "specrl.apps.cli", "bench", "fleet", "--model", "tiny-random",
                               "--out", str(tmp_path), *flags], capture_output=True, text=True)
        assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr


def test_bench_fleet_publish_restart_and_learn_tiny(home, tmp_path, tiny_dir):
    """Two published drafters reach both replicas (records on each), and a SIGKILLed replica's successor writes
    its first record on the current drafter; only requests in flight on the killed replica may fail. Learning: one
    replica, then two, each deployment's trainer trains on its records; the drafters are measured."""
    from specrl.apps.bench.fleet import run_fleet_bench
    from tests.backends import REDIS_URL

    settings = Settings.load(home=home, model="tiny-random", threads=1, redis_url=REDIS_URL, port=free_port())
    result = run_fleet_bench(settings, replicas=2, nodes=1, tenants=4, rounds=2, users=2, repeats=1,
                             out_dir=str(tmp_path), scenarios=["publish", "restart", "learn"], publishes=2,
                             minutes=0.25)
    life = json.loads((tmp_path / "bench-fleet.json").read_text())["lifecycle"]
    assert result["runs"] == [] and len(life["replicas"]) == 2
    rows = life["publish"]["rows"]
    assert [row["version"] for row in rows] == ["v1", "v2"]
    assert all(set(row["seconds"]) == set(life["replicas"]) and min(row["seconds"].values()) > 0 for row in rows)
    restart = life["restart"]
    assert restart["replica"] not in life["replicas"] and restart["seconds_to_first_record"] > 0
    assert restart["drafter"] == "v2" and restart["serves_current"]
    assert restart["failed_requests"] <= 2 and life["failed_requests_before_restart"] == 0
    learning = result["learning"]
    assert [run["replicas"] for run in learning["runs"]] == [1, 2]
    for run in learning["runs"]:
        assert run["requests"] > 0 and run["failed_requests"] == 0 and run["trained_records"] > 0
        assert run["mean_acceptance_length_k4"] >= 1.0
        assert run["gain"] == run["mean_acceptance_length_k4"] - learning["day0"]["mean_acceptance_length_k4"]
    png = tmp_path / "bench-fleet.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE
