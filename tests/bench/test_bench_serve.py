"""`specrl bench serve`'s report logic, without servers: ratios per backend and across backends,
the per-scenario extras, the /metrics reader."""

import pytest

from specrl.apps.bench.serve import CROSS_METRICS, metric, prometheus_value, scenario_extras, serve_ratios
from specrl.loadtest.report import percentile

_percentile = percentile


def row(backend, scenario, speed, itl_p99, events_per_s=None, swap_ms=None):
    return {"backend": backend, "scenario": scenario, "requests_per_s": speed, "tokens_per_s": 20 * speed,
            "ttft_ms": {"p50": 100.0 / speed, "p99": 200.0 / speed}, "itl_ms": {"p50": 10.0, "p99": itl_p99},
            "swap_call_ms_p50": swap_ms, "drafter_visible_ms_p50": None, "events_per_s": events_per_s}


def test_metric_reads_percentiles_and_fields():
    r = row("native", "baseline", 2.0, 30.0, events_per_s=7.0)
    assert metric(r, "ttft_p99") == 100.0 and metric(r, "itl_p50") == 10.0
    assert metric(r, "events_per_s") == 7.0 and metric(r, "swap_call_ms_p50") is None
    assert metric(None, "tokens_per_s") is None


def test_ratios_within_and_across_backends():
    rows = [row("native", "telemetry_off", 4.0, 20.0), row("native", "baseline", 2.0, 30.0, events_per_s=8.0),
            row("native", "drafter_swaps", 2.0, 60.0, events_per_s=8.0, swap_ms=10.0),
            row("vllm", "telemetry_off", 1.0, 50.0), row("vllm", "baseline", 1.0, 50.0, events_per_s=2.0),
            row("vllm", "drafter_swaps", 1.0, 100.0, events_per_s=2.0, swap_ms=40.0)]
    ratios = serve_ratios(rows)
    assert ratios["native"]["itl_p99_drafter_swaps_over_baseline"] == 2.0
    assert ratios["native"]["requests_per_s_telemetry_on_over_off"] == 0.5
    assert ratios["native"]["itl_p99_policy_swaps_over_baseline"] is None  # not run
    assert ratios["vllm"]["tokens_per_s_telemetry_on_over_off"] == 1.0
    across = ratios["vllm_over_native"]
    assert set(across) == {"telemetry_off", "baseline", "drafter_swaps"}
    assert set(across["baseline"]) == set(CROSS_METRICS)
    assert across["baseline"]["requests_per_s"] == 0.5 and across["baseline"]["ttft_p99"] == 2.0
    assert across["drafter_swaps"]["swap_call_ms_p50"] == 4.0 and across["baseline"]["events_per_s"] == 0.25
    assert across["telemetry_off"]["events_per_s"] is None
    assert "vllm_over_native" not in serve_ratios(rows[:3])


def test_scenario_extras():
    summary = {"span_s": 4.0, "swaps": {"swap_ms": [30.0, 10.0, 20.0], "load_ms": [1.0, 3.0]},
               "drafter_visibility_ms": [None, 50.0, 150.0]}
    swap_log = [{"event": "start"}, {"event": "swap", "status": 200, "before": 10.0, "after": 10.5},
                {"event": "swap", "status": 409, "before": 11.0, "after": 11.01},
                {"event": "swap", "status": 200, "before": 12.0, "after": 12.3}]
    extras = scenario_extras(summary, swap_log, (8, 80), _percentile)
    assert extras == pytest.approx({"swap_call_ms_p50": 400.0, "swap_ms_p50": 20.0, "load_ms_p50": 2.0,
                                    "drafter_visible_ms_p50": 100.0, "records": 8, "events": 80, "records_per_s": 2.0,
                                    "events_per_s": 20.0})
    quiet = scenario_extras({"span_s": 4.0}, [], None, _percentile)
    assert quiet["events"] is None and quiet["events_per_s"] is None and quiet["swap_ms_p50"] is None


def test_prometheus_value():
    text = ("# HELP specrl_telemetry_records_dropped_total Event records dropped\n"
            "specrl_telemetry_records_dropped_total 3.0\nspecrl_x{a=\"b\"} 1\n")
    assert prometheus_value(text, "specrl_telemetry_records_dropped_total") == pytest.approx(3.0)
    assert prometheus_value(text, "missing_total") is None


@pytest.mark.redis
def test_events_since_counts_records_and_their_steps():
    import secrets

    import redis

    from specrl.apps.bench.serve import _Server
    from specrl.telemetry.record import SegmentRecord, StepRecord
    from specrl.telemetry.redis_sink import RECORD_FIELD

    stream = f"specrl-test-bench-{secrets.token_hex(6)}"
    server = _Server("native", "http://127.0.0.1:1", None, None, "token", stream, "redis://127.0.0.1:6379/0")
    client = redis.Redis.from_url(server.redis_url)

    def add(steps: int) -> None:
        record = SegmentRecord("req", steps, "base", "day0", steps=[StepRecord(1, 0, [], [], 0, 7)] * steps)
        client.xadd(stream, {RECORD_FIELD: record.to_msgpack()})

    try:
        assert server.last_event_id() == "0-0"
        add(1)
        before = server.last_event_id()
        add(2)
        add(3)
        assert server.events_since(before) == (2, 5) and server.events_since("0-0") == (3, 6)
    finally:
        client.delete(stream)
    assert _Server("native", "u", None, None, "t", None, None).events_since(None) is None
