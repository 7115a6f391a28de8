"""`specrl bench serve`: a live `specrl serve` under locust load, scenarios side by side in one run.

Scenarios, each `duration_s` seconds of `users` locust users (loadtest/locustfile.py: chat and
text completions, streaming and not, 16-32 tokens):

- telemetry_off: a server without Redis (records stay in memory), no swaps;
- baseline: a server sending every record to Redis, no swaps;
- drafter_swaps: that server, a drafter swap every 2 s;
- policy_swaps: that server, a "drain" policy swap every 10 s.

The swaps come from loadtest/swap_driver.py (two day-0 drafters, the model and a perturbed copy
as policies, published in a temporary weights store). Per scenario: requests/s and completion
tokens/s over the span of finished requests, p50/p99 TTFT and ITL (loadtest/locustfile.py says
what they measure), failures, swap times, and for drafter swaps their visibility: ms from the
admin call to the first response showing the new drafter in its fingerprint. Ratios: p99 ITL
with swaps over baseline, and telemetry on over off throughput. The raw logs (requests, swaps,
locust CSV, server logs) are kept in the report directory. Needs a source checkout: the
locustfile and the swap driver live in loadtest/, outside the package.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from specrl.config import Settings
from specrl.errors import InvalidRequestError, SpecrlError
from specrl.launch import free_port, spawn, terminate, wait_healthy

LOADTEST = Path(__file__).resolve().parents[2] / "loadtest"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
START_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Scenario:
    name: str
    telemetry: bool
    roles: tuple[str, ...] = ()
    modes: tuple[str, ...] = ("drain",)
    interval_s: float = 0.0


SCENARIOS = (
    Scenario("telemetry_off", telemetry=False),
    Scenario("baseline", telemetry=True),
    Scenario("drafter_swaps", telemetry=True, roles=("drafter",), interval_s=2.0),
    Scenario("policy_swaps", telemetry=True, roles=("policy",), modes=("drain",), interval_s=10.0),
)


def run_serve_bench(settings: Settings, duration_s: float = 30.0, users: int = 4, out_dir: str | None = None) -> dict:
    """Run every scenario; print a table; write bench-serve.json and bench-serve.png. -> the report."""
    from specrl.assets import resolve_model

    if duration_s < 2 or users < 1:
        raise InvalidRequestError("--duration must be >= 2 seconds and --users >= 1")
    driver, report = _loadtest("swap_driver"), _loadtest("report")
    out = Path(out_dir) if out_dir else settings.home / "reports" / f"bench-serve-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(settings.model, settings.home)
    redis_url = settings.redis_url or DEFAULT_REDIS
    rows, timelines, servers = [], {}, []
    with tempfile.TemporaryDirectory(prefix="specrl-bench-serve-") as tmp:
        _progress(f"preparing weight versions of {settings.model} in {tmp}")
        versions = driver.prepare_versions(Path(tmp) / "store", model_dir)
        for telemetry in (False, True):
            server = _Server.start(settings, Path(tmp) / "store", out, redis_url if telemetry else None)
            try:
                for scenario in (s for s in SCENARIOS if s.telemetry == telemetry):
                    row, timelines[scenario.name] = _run_scenario(scenario, server, versions, duration_s, users,
                                                                  out / scenario.name, driver, report)
                    rows.append(row)
            finally:
                servers.append(server.stop())
    result = _result(settings, model_dir, duration_s, users, versions, rows, servers, redis_url)
    _print_table(result)
    (out / "bench-serve.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, timelines, out / "bench-serve.png")
    print(f"report: {out / 'bench-serve.json'}\nchart:  {out / 'bench-serve.png'}")
    return result


def _loadtest(name: str):
    """Load loadtest/<name>.py from the source checkout (loadtest/ is not part of the package)."""
    path = LOADTEST / f"{name}.py"
    if not path.is_file():
        raise SpecrlError(f"the serve bench needs a source checkout: {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"specrl_loadtest_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _progress(message: str) -> None:
    print(f"bench serve: {message}", file=sys.stderr, flush=True)


# ---- one server --------------------------------------------------------------------------
@dataclass
class _Server:
    url: str
    proc: subprocess.Popen
    log: Path
    token: str
    stream: str | None  # the Redis stream it writes to, None without telemetry
    redis_url: str | None

    @classmethod
    def start(cls, settings: Settings, store: Path, out: Path, redis_url: str | None) -> "_Server":
        """`specrl serve` on a free loopback port, with an admin token; waits until /health answers."""
        port = free_port()
        deployment, token = f"bench-{secrets.token_hex(6)}", secrets.token_hex(16)
        log = out / f"serve-{'telemetry' if redis_url else 'no-telemetry'}-{port}.log"
        args = ["serve", "--model", settings.model, "--home", str(settings.home), "--host", "127.0.0.1",
                "--port", str(port), "--store", str(store), "--deployment", deployment, "--drafter", settings.drafter,
                "--max-batch", str(settings.max_batch), "--max-draft-tokens", str(settings.max_draft_tokens),
                "--threads", str(settings.threads)]
        args += ["--redis-url", redis_url] if redis_url else []
        env = {**os.environ, "SPECRL_ADMIN_TOKEN": token}
        env.pop("SPECRL_REDIS_URL", None)  # telemetry off means off
        _progress(f"starting server redis={redis_url or 'off'} log={log}")
        proc = spawn(args, env, log)
        server = cls(f"http://127.0.0.1:{port}", proc, log, token,
                     f"specrl:{deployment}:events" if redis_url else None, redis_url)
        wait_healthy(server.url, proc, log, START_TIMEOUT_S)
        return server

    def stop(self, timeout: float = 60.0) -> dict:
        """SIGTERM, wait; delete its Redis stream. -> {exit_code, log, error_lines}."""
        terminate(self.proc, timeout)
        records = None
        if self.stream:
            import redis

            client = redis.Redis.from_url(self.redis_url)
            records = client.xlen(self.stream)
            client.delete(self.stream)
        errors = [line for line in self.log.read_text().splitlines() if "level=ERROR" in line or "Traceback" in line]
        return {"exit_code": self.proc.returncode, "log": str(self.log), "redis_records": records,
                "error_lines": errors[:20]}


# ---- one scenario ------------------------------------------------------------------------
def _run_scenario(scenario: Scenario, server: _Server, versions: dict, duration_s: float, users: int, out: Path,
                  driver, report) -> tuple[dict, dict]:
    """Locust (its own process) against `server` while a thread swaps as the scenario says. -> (row, timeline)."""
    out.mkdir(parents=True, exist_ok=True)
    requests_log, swaps_log, prefix = out / "requests.jsonl", out / "swaps.jsonl", out / "locust"
    for path in (requests_log, swaps_log):
        path.unlink(missing_ok=True)
    _progress(f"scenario={scenario.name} duration={duration_s:g}s users={users} "
              f"swaps={','.join(scenario.roles) or 'none'}" + (f" every {scenario.interval_s:g}s" if scenario.roles else ""))
    cmd = [sys.executable, "-m", "locust", "-f", str(LOADTEST / "locustfile.py"), "--headless", "-u", str(users),
           "-r", str(users), "-t", f"{duration_s:g}s", "--stop-timeout", "30", "--host", server.url,
           "--csv", str(prefix), "--only-summary"]
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        swapping = pool.submit(driver.run_swaps, server.url, server.token, versions, roles=scenario.roles,
                               modes=scenario.modes, interval_s=scenario.interval_s or duration_s,
                               duration_s=duration_s, log_path=swaps_log, stop=stop)
        try:
            locust = subprocess.run(cmd, env={**os.environ, "SPECRL_LOADTEST_LOG": str(requests_log)},
                                    capture_output=True, text=True, timeout=duration_s + 180)
        finally:
            stop.set()
        swapping.result()
    (out / "locust.log").write_text(locust.stdout + locust.stderr)
    requests, swaps = report.read_jsonl(requests_log), report.read_jsonl(swaps_log)
    ok = [r for r in requests if r["status"] == "ok"]
    row = {"scenario": scenario.name, "telemetry": scenario.telemetry, "swap_roles": list(scenario.roles),
           "swap_interval_s": scenario.interval_s or None, "locust_exit_code": locust.returncode,
           "locust_failures": int(report.locust_aggregated(prefix)["Failure Count"]),
           **report.summarize(requests, swaps), "version_problems": report.version_problems(ok, swaps)[:10],
           "logs": str(out)}
    _progress(f"scenario={scenario.name} requests={row['requests_ok']} failed={row['requests_failed']} "
              f"req_per_s={row['requests_per_s']:.2f} tokens_per_s={row['tokens_per_s']:.1f} "
              f"itl_p99_ms={_fmt(row['itl_ms']['p99'])} swaps={row['swaps']['ok']}/{row['swaps']['count']}")
    t0 = min((r["start"] for r in ok), default=time.time())
    timeline = {"requests": [(r["start"] - t0, r.get("ttft_ms"), max(r.get("itl_ms") or [0.0])) for r in ok
                             if r["stream"]],
                "swaps": [(e["before"] - t0, e["role"]) for e in swaps if e["event"] == "swap" and e["status"] == 200]}
    return row, timeline


# ---- report ------------------------------------------------------------------------------
def _result(settings: Settings, model_dir: Path, duration_s: float, users: int, versions: dict, rows: list[dict],
            servers: list[dict], redis_url: str) -> dict:
    import torch
    import transformers

    from specrl import __version__

    by = {r["scenario"]: r for r in rows}

    def ratio(a, b):
        return a / b if a is not None and b else None

    base = by["baseline"]
    ratios = {
        "itl_p99_drafter_swaps_over_baseline": ratio(by["drafter_swaps"]["itl_ms"]["p99"], base["itl_ms"]["p99"]),
        "itl_p99_policy_swaps_over_baseline": ratio(by["policy_swaps"]["itl_ms"]["p99"], base["itl_ms"]["p99"]),
        "ttft_p99_policy_swaps_over_baseline": ratio(by["policy_swaps"]["ttft_ms"]["p99"], base["ttft_ms"]["p99"]),
        "requests_per_s_telemetry_on_over_off": ratio(base["requests_per_s"], by["telemetry_off"]["requests_per_s"]),
        "tokens_per_s_telemetry_on_over_off": ratio(base["tokens_per_s"], by["telemetry_off"]["tokens_per_s"]),
    }
    return {
        "command": sys.argv, "timestamp": datetime.now().astimezone().isoformat(timespec="seconds"),
        "versions": {"specrl": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "locust": importlib.metadata.version("locust"), "python": sys.version.split()[0]},
        "model": settings.model, "model_dir": str(model_dir), "weights": versions, "redis_url": redis_url,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(settings).items()
                     if k != "admin_token"},
        "duration_s": duration_s, "users": users, "scenarios": rows, "ratios": ratios, "servers": servers,
    }


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _print_table(result: dict) -> None:
    print(f"{'scenario':<14} {'req/s':>6} {'tok/s':>7} {'TTFT p50':>8} {'p99':>7} {'ITL p50':>7} {'p99':>7} "
          f"{'acc.len':>7} {'fail':>4} {'swaps':>5} {'visible ms (median)':>19}")
    for r in result["scenarios"]:
        seen = sorted(v for v in r.get("drafter_visibility_ms", []) if v is not None)
        print(f"{r['scenario']:<14} {r['requests_per_s']:>6.2f} {r['tokens_per_s']:>7.1f} "
              f"{_fmt(r['ttft_ms']['p50']):>8} {_fmt(r['ttft_ms']['p99']):>7} {_fmt(r['itl_ms']['p50']):>7} "
              f"{_fmt(r['itl_ms']['p99']):>7} {_fmt(r['mean_acceptance_length'], '.2f'):>7} "
              f"{r['requests_failed'] + r['locust_failures']:>4} "
              f"{r['swaps']['ok']:>5} {_fmt(seen[len(seen) // 2] if seen else None):>19}")
    for name, value in result["ratios"].items():
        print(f"{name}: {_fmt(value, '.2f')}")


def _plot(result: dict, timelines: dict, path: Path) -> None:
    """Left: per scenario, TTFT and worst ITL of each streamed request over time, swaps as vertical
    lines. Right: requests/s per scenario (tokens/s on the bars)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    rows = result["scenarios"]
    fig = Figure(figsize=(13, 2.4 * len(rows) + 0.6))
    grid = fig.add_gridspec(len(rows), 2, width_ratios=(2.2, 1))
    first = None
    for i, row in enumerate(rows):
        ax = fig.add_subplot(grid[i, 0], sharex=first)
        first = first or ax
        line = timelines[row["scenario"]]
        points = line["requests"]
        ax.scatter([p[0] for p in points if p[1] is not None], [p[1] for p in points if p[1] is not None], s=6,
                   label="TTFT")
        ax.scatter([p[0] for p in points], [p[2] for p in points], s=6, marker="x", label="worst ITL")
        for j, (t, role) in enumerate(line["swaps"]):
            ax.axvline(t, color="tab:red" if role == "policy" else "tab:green", linestyle=":", linewidth=1,
                       label=f"{role} swap" if j == 0 else None)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("ms")
        ax.set_title(row["scenario"], fontsize="small", loc="left")
        ax.legend(fontsize="x-small", loc="upper right")
    ax.set_xlabel("seconds since the scenario's first request")
    bars = fig.add_subplot(grid[:, 1])
    names = [r["scenario"] for r in rows]
    drawn = bars.bar(names, [r["requests_per_s"] for r in rows], color="tab:blue")
    for rect, r in zip(drawn, rows):
        bars.annotate(f"{r['tokens_per_s']:.0f} tok/s", (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                      ha="center", va="bottom", fontsize="small")
    bars.set_ylabel("requests/s")
    bars.tick_params(axis="x", labelrotation=30)
    bars.set_title(f"{result['model']}, {result['users']} users, {result['duration_s']:g} s each", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
