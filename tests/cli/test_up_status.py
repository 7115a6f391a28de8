"""`specrl up`'s status line: the trainer's production vs consumption, lag, expired and replayed
records and the token yield, from the two /metrics samples (no processes)."""

from specrl.apps.launch import free_port
from specrl.apps.scrape import yield_of
from specrl.apps.up import _status_line


def sample(trainer):
    server = {"uses": {"prompt": 300.0, "served": 100.0, "prompt_repeated": 50.0, "draft_rejected": 50.0}}
    return {"t": 60.0, "requests_per_s": 1.0, "tokens_per_s": 20.0, "speedup": 1.2, "tokens_per_step": 1.5,
            "suffix_acceptance_rate": 0.5, "head_acceptance_rate": 0.25, "policy": "base", "drafter": "day0",
            "swap": False, "trainer": trainer, "yield": yield_of(server, trainer)}


def test_the_status_line_shows_the_trainers_rates_lag_and_the_yield():
    trainer = {"produced_records_per_s": 0.81, "consumed_records_per_s": 0.74, "lag_records": 12.0, "lag_s": 31.0,
               "expired": 3.0, "replays": 0.0, "uses": {"trained": 200.0, "trainer_recomputed": 0.0}}
    line = _status_line(sample(trainer))
    assert "trainer: in=0.81 out=0.74 rec/s lag=12 rec/31s expired=3 replays=0" in line
    assert "yield=80%" in line  # useful 400 of 500 computed


def test_the_status_line_says_when_the_trainer_does_not_answer():
    line = _status_line(sample(None))
    assert "trainer: -" in line and "yield" not in line


def test_behind_ray_serves_proxy_the_status_line_names_the_replica_it_sampled():
    line = _status_line({**sample(None), "replica": "ray-abc"}, with_replica=True)
    assert line.startswith("replica=ray-abc  t=") and "replica=" not in _status_line(sample(None))


def test_up_ray_refuses_a_fleet_it_cannot_make_in_one_line(capsys):
    from specrl.apps.cli import main

    for args in (["--replicas", "0"], ["--replicas", "3", "--max-replicas", "2"]):
        assert main(["up", "--ray", *args, "--duration", "1"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--replicas must be >= 1" in err[0]
    assert main(["up", "--ray", "--max-replicas", "3", "--scale-down-after", "-1", "--duration", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--scale-down-after must be >= 0 seconds (got -1.0)" in err[0]
    assert main(["up", "--ray", "--replicas", "2", "--scale-down-after", "60", "--duration", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--scale-down-after needs --max-replicas above --replicas" in err[0]
    for command in ("up", "rl"):  # an address with no Ray cluster behind it, and one that is no address
        for address, message in ((f"127.0.0.1:{free_port()}", "no Ray cluster answers there"),
                                 ("nowhere", "give HOST:PORT")):
            assert main([command, "--ray", address, "--minutes" if command == "rl" else "--duration", "1"]) == 1
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and message in err[0], err


def test_the_report_draws_and_lists_each_replica_it_sampled(tmp_path):
    import json

    import matplotlib.image

    from specrl.apps.up import _report
    from specrl.config import Settings

    samples = [{**sample(None), "t": 5.0 * i, "replica": f"ray-{'ab'[i % 2]}", "drafter": "v1" if i < 3 else "v2",
                "swap": i == 3} for i in range(6)]
    report = _report(tmp_path, samples, Settings.load(model="tiny-random"))
    assert report["replicas"] == ["ray-a", "ray-b"] and report["swaps"] == [
        {"t": 15.0, "replica": "ray-b", "drafter": "v2", "policy": "base"}]
    assert json.loads((tmp_path / "report.json").read_text())["replicas"] == ["ray-a", "ray-b"]
    height, width, _ = matplotlib.image.imread(tmp_path / "report.png").shape
    assert height > 500 and width > 500
