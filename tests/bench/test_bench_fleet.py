"""`specrl bench fleet` on the tiny model, two replicas on one local Ray node: both routers run on fresh replicas,
routed by prefix every counted turn reuses its tenant's system prompt, the report and the chart; bad flags get one
line. Slow: two Serve deployments (~25 s each)."""

import importlib.util
import json
import subprocess
import sys

import matplotlib.image
import pytest

from specrl.config import Settings

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the [ray] extra is not installed")]


def test_bench_fleet_tiny(home, tmp_path, capsys, tiny_dir):
    from specrl.apps.bench.fleet import run_fleet_bench

    settings = Settings.load(home=home, model="tiny-random", threads=1, drafter="none")
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
                           (["--replicas", "0"], "--replicas must be at least 1")):
        done = subprocess.run([sys.executable, "-m", "specrl.apps.cli", "bench", "fleet", "--model", "tiny-random",
                               "--out", str(tmp_path), *flags], capture_output=True, text=True)
        assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr
