"""`specrl bench fleet --scenarios autoscale`'s arithmetic on a made-up timeline (the live run needs Ray and minutes:
tests/serving/test_ray_replicas.py drives the same autoscaling through a scale-up and a scale-down)."""

from __future__ import annotations

import pytest

from specrl.apps.bench.fleet_autoscale import WINDOW_S, summarize


def timeline():
    """One replica for 10 s, two from t=10; the calm from t=30; back to one at t=42; the run ends at t=50.
    Every second requests finish with 10 tokens a replica under the load, 5 in the calm; one fails at t=35."""
    start = 1000.0
    samples = [(start + t, 1 if t < 10 or t >= 42 else 2) for t in range(50)]
    requests = []
    for t in range(50):
        replicas = 1 if t < 10 or t >= 42 else 2
        tokens = 10 * replicas if t < 30 else 5
        requests.append((start + t - 0.5, start + t + 0.5, tokens, True))
    requests.append((start + 34.0, start + 35.0, 0, False))
    return requests, samples, start


def test_the_timeline_gives_the_scaling_times_and_the_rate_each_fleet_served_under_the_same_load():
    requests, samples, start = timeline()
    report = summarize(requests, samples, start, start + 30, start + 50, max_replicas=2, users=8,
                       reached={"load": True, "calm": True})
    windows = report["windows"]
    assert [w["t"] for w in windows] == [t * WINDOW_S for t in range(10)]
    assert [w["phase"] for w in windows] == ["load"] * 6 + ["calm"] * 4
    assert [w["replicas"] for w in windows] == [1, 1, 2, 2, 2, 2, 2, 2, 2, 1]  # the largest seen in the window
    assert report["seconds_to_scale_up"] == 10 and report["seconds_to_scale_down"] == 12
    # the first window (the replica warming) is left out; a window counts for a fleet size only if held throughout
    assert report["load_tokens_per_s_one_replica"] == pytest.approx(10.0)
    assert report["load_tokens_per_s_all_replicas"] == pytest.approx(20.0)
    assert report["all_over_one"] == pytest.approx(2.0)
    assert report["requests"] == 51 and report["failed_requests"] == 1
    assert windows[7]["failed"] == 1 and windows[7]["tokens_per_s"] == pytest.approx(5.0)


def test_the_window_where_the_load_falls_counts_for_neither_phase():
    requests, samples, start = timeline()
    report = summarize(requests, samples, start, start + 27, start + 50, max_replicas=2, users=8,
                       reached={"load": True, "calm": True})
    assert [w["phase"] for w in report["windows"]] == ["load"] * 5 + ["switch"] + ["calm"] * 4
    assert report["load_tokens_per_s_all_replicas"] == pytest.approx(20.0)  # windows 10-25 only
    assert report["seconds_to_scale_down"] == 15  # from the calm's start (t=27) to one replica (t=42)


def test_a_fleet_that_never_scaled_reports_no_ratio():
    requests, samples, start = timeline()
    flat = [(t, 1) for t, _ in samples]
    report = summarize(requests, flat, start, start + 30, start + 50, max_replicas=2, users=8,
                       reached={"load": False, "calm": True})
    assert report["seconds_to_scale_up"] is None and report["load_tokens_per_s_all_replicas"] is None
    assert report["all_over_one"] is None and report["seconds_to_scale_down"] == 0
