"""`specrl bench serve`: a live `specrl serve` under locust load, scenarios side by side in one run,
for each backend of `--backend native,vllm`; and the prefix-reuse workloads (`--scenarios`).

Swap scenarios ("swaps"), each `duration_s` seconds of `users` locust users (loadtest/locustfile.py: chat and
text completions, streaming and not, 16-32 tokens):

- telemetry_off: a server without Redis (records stay in memory), no swaps;
- baseline: a server sending every record to Redis, no swaps;
- drafter_swaps: that server, a drafter swap every 2 s;
- policy_swaps: that server, a "drain" policy swap every 10 s.

The swaps come from specrl.loadtest.swap_driver (two day-0 drafters, the model and a perturbed copy
as policies, published in a temporary weights store). Per scenario: requests/s and completion
tokens/s over the span of finished requests, p50/p99 TTFT and ITL (loadtest/locustfile.py says
what they measure), failures, swap latency, for drafter swaps their visibility: ms from the
admin call to the first response showing the new drafter in its fingerprint, and with
telemetry what the server wrote to Redis during the scenario: segment records (stream
entries) and the per-step events inside them, per second over the same span as requests/s
(the records its sink dropped beside them). Ratios per
backend: p99 ITL with swaps over baseline, telemetry on over off throughput; across backends:
vLLM / native per scenario and metric.

Prefix reuse ("prefix", specrl/apps/bench/prefix_reuse.py): per backend two servers without
telemetry, prefix cache on and off (`--no-prefix-cache`), at least 8 KV slots; shared_prefix
(a 1,000-token system prompt, varied user turns: TTFT p50) and n8 (n = 8 completions: time to the
8th first token), with reuse over without and the issue's targets.

Swap latency, compared across backends, is the admin call's wall time as the swap driver sees
it (verify against the manifest, load, apply). The servers' own `swap_ms` and `load_ms` are
kept beside it but mean different things: native loads and checks on a worker thread
(`load_ms`) and `swap_ms` is the wait for the next step boundary only (a "drain" policy swap
lets running requests finish on the old weights, both models in memory); the vLLM backend
pauses the engine (a "drain" policy swap: stops admitting and waits until every running
request has finished), loads with layerwise reload and resumes, and its `swap_ms` spans all of it.

Fairness: every backend serves the same model, drafter and store. Before each backend's
servers start, the store's `current` pointers are set to the same published versions (the
base policy and the first day-0 drafter), so swaps of one backend do not change what the next
one starts with. Both get the same compute threads (`--threads`, default: vLLM's own default
on CPU, all usable cores but one): native as torch threads, vLLM as OpenMP threads of its model
worker, unpinned (`backends.vllm_env`); vLLM's API and engine-core processes come on top, as
they do in production. The raw logs (requests, swaps, locust CSV, server logs) are kept in
the report directory.
"""

from __future__ import annotations

import argparse
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

from specrl.apps.bench import prefix_reuse
from specrl.apps.bench.backends import (NATIVE, VLLM, add_backends_flag, bench_threads, parse_backends, ratio,
                                        settings_record, vllm_env, vllm_version)
from specrl.apps.flags import COMMON, ENGINE, add_settings, settings_from
from specrl.apps.bench.swap_versions import prepare_versions
from specrl.apps.launch import free_port, spawn, terminate, wait_healthy
from specrl.loadtest import report, swap_driver
from specrl.config import Settings
from specrl.errors import InvalidRequestError
from specrl.redis_conn import connect

# Run by locust in its own process, never imported here: importing locust patches the network (gevent).
LOCUSTFILE = Path(importlib.util.find_spec("specrl.loadtest.locustfile").origin)
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
START_TIMEOUT_S = 600.0
SCENARIO_GROUPS = ("swaps", "prefix")  # the locust scenarios with swaps and telemetry; prefix reuse
FLUSH_WAIT_S = 1.0  # after a scenario, for the servers' sinks to send what they queued
# metrics compared across backends, vLLM over native (`metric` reads them from a row)
CROSS_METRICS = ("requests_per_s", "tokens_per_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "swap_call_ms_p50",
                 "drafter_visible_ms_p50", "events_per_s", "records_per_s")
# (ratio name, metric, scenario over scenario) within one backend
WITHIN_RATIOS = (
    ("itl_p99_drafter_swaps_over_baseline", "itl_p99", "drafter_swaps", "baseline"),
    ("itl_p99_policy_swaps_over_baseline", "itl_p99", "policy_swaps", "baseline"),
    ("ttft_p99_policy_swaps_over_baseline", "ttft_p99", "policy_swaps", "baseline"),
    ("requests_per_s_telemetry_on_over_off", "requests_per_s", "baseline", "telemetry_off"),
    ("tokens_per_s_telemetry_on_over_off", "tokens_per_s", "baseline", "telemetry_off"),
)


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


def register(sub) -> None:
    p = sub.add_parser("serve", help="a live server under locust load: no swaps, drafter and policy swaps, "
                                     "telemetry off vs on; per backend, with ratios")
    add_backends_flag(p)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load per scenario")
    p.add_argument("--users", type=int, default=4, help="concurrent locust users")
    p.add_argument("--out", default=None, help="report directory (default <home>/reports/bench-serve-<time>)")
    p.add_argument("--scenarios", default=",".join(SCENARIO_GROUPS),
                   help="comma-separated groups: swaps (locust load, swaps, telemetry off/on; needs Redis), prefix "
                        "(shared 1,000-token system prompt and n=8, prefix cache on vs off)")
    p.add_argument("--prefix-requests", type=int, default=12,
                   help="shared-prefix requests per server (n=8 trials: a quarter of it, at least 2)")
    add_settings(p, *COMMON, *ENGINE, "redis_url")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    backends = parse_backends(args.backends)
    groups = tuple(g.strip() for g in args.scenarios.split(",") if g.strip())
    run_serve_bench(settings_from(args), duration_s=args.duration, users=args.users, out_dir=args.out,
                    backends=tuple(backends), groups=groups, prefix_requests=args.prefix_requests)
    return 0


def run_serve_bench(settings: Settings, duration_s: float = 30.0, users: int = 4, out_dir: str | None = None,
                    backends: tuple[str, ...] = (NATIVE,), groups: tuple[str, ...] = SCENARIO_GROUPS,
                    prefix_requests: int = 12) -> dict:
    """Run the scenario groups on every backend; print tables; write bench-serve.json and (with
    the swap scenarios) bench-serve.png. -> the report."""
    from specrl.assets import resolve_model

    if duration_s < 2 or users < 1:
        raise InvalidRequestError("--duration must be >= 2 seconds and --users >= 1")
    unknown = [g for g in groups if g not in SCENARIO_GROUPS]
    if unknown or not groups:
        raise InvalidRequestError(f"--scenarios takes some of {','.join(SCENARIO_GROUPS)}, got {','.join(groups)!r}")
    if prefix_requests < 1:
        raise InvalidRequestError("--prefix-requests must be >= 1")
    out = Path(out_dir) if out_dir else settings.home / "reports" / f"bench-serve-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(settings.model, settings.home)
    redis_url = settings.redis_url or DEFAULT_REDIS
    settings = settings.replace(threads=bench_threads(settings.threads))
    rows, timelines, servers, prefix_rows = [], {}, [], []
    with tempfile.TemporaryDirectory(prefix="specrl-bench-serve-") as tmp:
        _progress(f"preparing weight versions of {settings.model} in {tmp}")
        store = Path(tmp) / "store"
        versions = prepare_versions(store, model_dir)
        for backend in backends:
            _reset_current(store, versions)
            for telemetry in (False, True) if "swaps" in groups else ():
                server = _Server.start(settings, store, out, redis_url if telemetry else None, backend)
                try:
                    for scenario in (s for s in SCENARIOS if s.telemetry == telemetry):
                        row, timelines[backend, scenario.name] = _run_scenario(
                            scenario, server, versions, duration_s, users, out / backend / scenario.name)
                        rows.append(row)
                finally:
                    servers.append(server.stop())
            if "prefix" in groups:
                prefix_rows += _run_prefix_reuse(settings, store, out, backend, prefix_requests, servers)
    result = _result(settings, model_dir, duration_s, users, versions, rows, servers, redis_url, backends)
    result["prefix_reuse"] = {"rows": prefix_rows, "ratios": prefix_reuse.reuse_ratios(prefix_rows)}
    if rows:
        _print_table(result)
    if prefix_rows:
        _print_prefix_table(result["prefix_reuse"])
    (out / "bench-serve.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"report: {out / 'bench-serve.json'}")
    if rows:
        _plot(result, timelines, out / "bench-serve.png")
        print(f"chart:  {out / 'bench-serve.png'}")
    return result


def _run_prefix_reuse(settings: Settings, store: Path, out: Path, backend: str, requests: int,
                      servers: list[dict]) -> list[dict]:
    """The prefix-reuse workloads against a server with the prefix cache on, then one with it off
    (no telemetry; room for n = 8 at once). -> their rows; the servers' records join `servers`."""
    rows = []
    for on in (True, False):
        server = _Server.start(settings.replace(prefix_cache=on, max_batch=max(settings.max_batch, prefix_reuse.N)),
                               store, out, None, backend)
        try:
            _progress(f"backend={backend} prefix reuse prefix_cache={'on' if on else 'off'} requests={requests}")
            for scenario, row in prefix_reuse.measure(server.url, settings.model, requests, settings.seed).items():
                rows.append({"backend": backend, "scenario": scenario, "prefix_cache": on, **row})
        finally:
            servers.append(server.stop())
    return rows


def _reset_current(store_root: Path, versions: dict[str, list[str]]) -> None:
    """Point the store's `current` at the first prepared drafter and the base policy (the
    model's own files): every backend's servers start from the same weights."""
    from specrl.weights import WeightsStore

    store = WeightsStore(store_root)
    store.set_current("drafter", versions["drafter"][0])
    store.set_current("policy", versions["policy"][-1])  # prepare_versions lists the base policy last


def _progress(message: str) -> None:
    print(f"bench serve: {message}", file=sys.stderr, flush=True)


# ---- one server --------------------------------------------------------------------------
@dataclass
class _Server:
    backend: str
    url: str
    proc: subprocess.Popen
    log: Path
    token: str
    stream: str | None  # the Redis stream it writes to, None without telemetry
    redis_url: str | None
    startup_s: float = 0.0

    @classmethod
    def start(cls, settings: Settings, store: Path, out: Path, redis_url: str | None, backend: str) -> "_Server":
        """`specrl serve --backend <backend>` on a free loopback port, with an admin token; waits
        until /health answers."""
        from specrl.telemetry.redis_sink import events_stream

        port = free_port()
        deployment, token = f"bench-{secrets.token_hex(6)}", secrets.token_hex(16)
        log = out / f"serve-{backend}-{'telemetry' if redis_url else 'no-telemetry'}-{port}.log"
        args = ["serve", "--backend", backend, "--model", settings.model, "--home", str(settings.home),
                "--host", "127.0.0.1", "--port", str(port), "--store", str(store), "--deployment", deployment,
                "--drafter", settings.drafter, "--max-batch", str(settings.max_batch),
                "--max-draft-tokens", str(settings.max_draft_tokens), "--threads", str(settings.threads),
                "--prefix-cache" if settings.prefix_cache else "--no-prefix-cache"]
        args += ["--redis-url", redis_url] if redis_url else []
        env = {**os.environ, "SPECRL_ADMIN_TOKEN": token}
        if backend != NATIVE:  # its exported drafters go to the bench's temporary directory, removed at the end
            env.update(vllm_env(settings.threads), TMPDIR=str(store.parent))
        env.pop("SPECRL_REDIS_URL", None)  # telemetry off means off
        _progress(f"starting server backend={backend} redis={redis_url or 'off'} log={log}")
        started = time.perf_counter()
        proc = spawn(args, env, log)
        server = cls(backend, f"http://127.0.0.1:{port}", proc, log, token,
                     events_stream(deployment) if redis_url else None, redis_url)
        wait_healthy(server.url, proc, log, START_TIMEOUT_S)
        server.startup_s = time.perf_counter() - started
        _progress(f"server backend={backend} ready seconds={server.startup_s:.1f}")
        return server

    def _redis(self):
        return connect(self.redis_url)

    def last_event_id(self) -> str | None:
        """The id of the newest entry of its stream ("0-0" before the first; None without telemetry)."""
        if not self.stream:
            return None
        entries = self._redis().xrevrange(self.stream, count=1)
        return entries[0][0].decode() if entries else "0-0"

    def events_since(self, last_id: str | None) -> tuple[int, int] | None:
        """-> (segment records, step events in them) appended to its stream after `last_id`
        (None without telemetry)."""
        if last_id is None:
            return None
        from specrl.telemetry.record import SegmentRecord
        from specrl.telemetry.redis_sink import RECORD_FIELD

        entries = self._redis().xrange(self.stream, min=f"({last_id}", max="+")
        steps = sum(len(SegmentRecord.from_msgpack(fields[RECORD_FIELD.encode()]).steps) for _, fields in entries)
        return len(entries), steps

    def records_dropped(self) -> float | None:
        """The server's specrl_telemetry_records_dropped counter from /metrics (None when absent)."""
        import httpx

        try:
            text = httpx.get(self.url + "/metrics", timeout=10).text
        except httpx.HTTPError:
            return None
        return prometheus_value(text, "specrl_telemetry_records_dropped_total")

    def stop(self, timeout: float = 60.0) -> dict:
        """SIGTERM, wait; delete its Redis stream.
        -> {backend, exit_code, log, startup_s, redis_records, error_lines}."""
        terminate(self.proc, timeout)
        records = None
        if self.stream:
            client = self._redis()
            records = client.xlen(self.stream)
            client.delete(self.stream)
        errors = [line for line in self.log.read_text().splitlines() if "level=ERROR" in line or "Traceback" in line]
        return {"backend": self.backend, "exit_code": self.proc.returncode, "log": str(self.log),
                "startup_s": self.startup_s, "redis_records": records, "error_lines": errors[:20]}


def prometheus_value(text: str, name: str) -> float | None:
    """The value of the unlabelled sample `name` in Prometheus text exposition (None when absent)."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == name:
            return float(parts[1])
    return None


# ---- one scenario ------------------------------------------------------------------------
def _run_scenario(scenario: Scenario, server: _Server, versions: dict, duration_s: float, users: int,
                  out: Path) -> tuple[dict, dict]:
    """Locust (its own process) against `server` while a thread swaps as the scenario says. -> (row, timeline)."""
    out.mkdir(parents=True, exist_ok=True)
    requests_log, swaps_log, prefix = out / "requests.jsonl", out / "swaps.jsonl", out / "locust"
    for path in (requests_log, swaps_log):
        path.unlink(missing_ok=True)
    _progress(f"backend={server.backend} scenario={scenario.name} duration={duration_s:g}s users={users} "
              f"swaps={','.join(scenario.roles) or 'none'}" + (f" every {scenario.interval_s:g}s" if scenario.roles else ""))
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", str(users),
           "-r", str(users), "-t", f"{duration_s:g}s", "--stop-timeout", "30", "--host", server.url,
           "--csv", str(prefix), "--only-summary"]
    stop = threading.Event()
    last_event = server.last_event_id()
    with ThreadPoolExecutor(1) as pool:
        swapping = pool.submit(swap_driver.run_swaps, server.url, server.token, versions, roles=scenario.roles,
                               modes=scenario.modes, interval_s=scenario.interval_s or duration_s,
                               duration_s=duration_s, log_path=swaps_log, stop=stop)
        try:
            locust = subprocess.run(cmd, env={**os.environ, "SPECRL_LOADTEST_LOG": str(requests_log)},
                                    capture_output=True, text=True, timeout=duration_s + 180)
        finally:
            stop.set()
        swapping.result()
    time.sleep(FLUSH_WAIT_S if server.stream else 0.0)
    written = server.events_since(last_event)
    (out / "locust.log").write_text(locust.stdout + locust.stderr)
    requests, swaps = report.read_jsonl(requests_log), report.read_jsonl(swaps_log)
    ok = [r for r in requests if r["status"] == "ok"]
    summary = report.summarize(requests, swaps)
    row = {"backend": server.backend, "scenario": scenario.name, "telemetry": scenario.telemetry,
           "swap_roles": list(scenario.roles), "swap_interval_s": scenario.interval_s or None,
           "locust_exit_code": locust.returncode,
           "locust_failures": int(report.locust_aggregated(prefix)["Failure Count"]), **summary,
           **scenario_extras(summary, swaps, written, report.percentile),
           "telemetry_dropped_total": server.records_dropped() if server.stream else None,
           "version_problems": report.version_problems(ok, swaps)[:10], "logs": str(out)}
    _progress(f"backend={server.backend} scenario={scenario.name} requests={row['requests_ok']} "
              f"failed={row['requests_failed']} req_per_s={row['requests_per_s']:.2f} "
              f"tokens_per_s={row['tokens_per_s']:.1f} itl_p99_ms={_fmt(row['itl_ms']['p99'])} "
              f"swaps={row['swaps']['ok']}/{row['swaps']['count']} swap_call_ms_p50={_fmt(row['swap_call_ms_p50'])} "
              f"events_per_s={_fmt(row['events_per_s'])}")
    t0 = min((r["start"] for r in ok), default=time.time())
    timeline = {"requests": [(r["start"] - t0, r.get("ttft_ms"), max(r.get("itl_ms") or [0.0])) for r in ok
                             if r["stream"]],
                "swaps": [(e["before"] - t0, e["role"]) for e in swaps if e["event"] == "swap" and e["status"] == 200]}
    return row, timeline


def scenario_extras(summary: dict, swap_log: list[dict], written: tuple[int, int] | None, percentile) -> dict:
    """The side-by-side numbers a scenario's summary does not hold: medians of the successful
    swaps' admin call (wall time the caller waits: verify, load, apply; the one swap latency
    both backends measure alike), of the server's own swap_ms and load_ms (their definitions
    differ by backend: see the module doc) and of drafter visibility; and what reached Redis
    (`written`: segment records, step events; None without telemetry), per second over the
    requests' span."""
    swaps = summary.get("swaps") or {}
    calls = [(e["after"] - e["before"]) * 1000 for e in swap_log if e.get("event") == "swap" and e["status"] == 200]
    seen = [v for v in summary.get("drafter_visibility_ms", []) if v is not None]
    records, events = written or (None, None)
    span = summary["span_s"]
    return {"swap_call_ms_p50": percentile(calls, 50),
            "swap_ms_p50": percentile([v for v in swaps.get("swap_ms", []) if v is not None], 50),
            "load_ms_p50": percentile([v for v in swaps.get("load_ms", []) if v is not None], 50),
            "drafter_visible_ms_p50": percentile(seen, 50), "records": records, "events": events,
            "records_per_s": records / span if written and span else None,
            "events_per_s": events / span if written and span else None}


# ---- report ------------------------------------------------------------------------------
def metric(row: dict | None, name: str) -> float | None:
    """A scenario row's value: "ttft_p99" / "itl_p50" and the like from its percentiles, else the row's field."""
    if row is None:
        return None
    kind, _, q = name.rpartition("_")
    if kind in ("ttft", "itl"):
        return row[f"{kind}_ms"][q]
    return row.get(name)


def serve_ratios(rows: list[dict]) -> dict:
    """Per backend, the WITHIN_RATIOS; with both backends, vLLM / native per scenario for every
    CROSS_METRICS entry. Missing rows or values give None."""
    by = {(r["backend"], r["scenario"]): r for r in rows}
    ratios: dict = {backend: {name: ratio(metric(by.get((backend, top)), m), metric(by.get((backend, bottom)), m))
                              for name, m, top, bottom in WITHIN_RATIOS}
                    for backend in dict.fromkeys(r["backend"] for r in rows)}
    scenarios = [r["scenario"] for r in rows if r["backend"] == NATIVE and (VLLM, r["scenario"]) in by]
    if scenarios:
        ratios["vllm_over_native"] = {s: {m: ratio(metric(by[VLLM, s], m), metric(by[NATIVE, s], m))
                                          for m in CROSS_METRICS} for s in scenarios}
    return ratios


def _result(settings: Settings, model_dir: Path, duration_s: float, users: int, versions: dict, rows: list[dict],
            servers: list[dict], redis_url: str, backends: tuple[str, ...]) -> dict:
    import torch
    import transformers

    from specrl import __version__

    return {
        "command": sys.argv, "timestamp": datetime.now().astimezone().isoformat(timespec="seconds"),
        "versions": {"specrl": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "locust": importlib.metadata.version("locust"), "vllm": vllm_version(),
                     "python": sys.version.split()[0]},
        "model": settings.model, "model_dir": str(model_dir), "weights": versions, "redis_url": redis_url,
        "settings": {k: v for k, v in settings_record(settings).items() if k not in ("admin_token", "api_key")},
        "backends": list(backends), "threads": settings.threads, "duration_s": duration_s, "users": users,
        "scenarios": rows, "ratios": serve_ratios(rows), "servers": servers,
    }


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _print_table(result: dict) -> None:
    print(f"{'backend':<7} {'scenario':<14} {'req/s':>6} {'tok/s':>7} {'TTFT p50':>8} {'p99':>7} {'ITL p50':>7} "
          f"{'p99':>7} {'acc.len':>7} {'fail':>4} {'swaps':>5} {'swap ms':>7} {'visible ms':>10} {'events/s':>8} "
          f"{'rec/s':>6}")
    for r in result["scenarios"]:
        print(f"{r['backend']:<7} {r['scenario']:<14} {r['requests_per_s']:>6.2f} {r['tokens_per_s']:>7.1f} "
              f"{_fmt(r['ttft_ms']['p50']):>8} {_fmt(r['ttft_ms']['p99']):>7} {_fmt(r['itl_ms']['p50']):>7} "
              f"{_fmt(r['itl_ms']['p99']):>7} {_fmt(r['mean_acceptance_length'], '.2f'):>7} "
              f"{r['requests_failed'] + r['locust_failures']:>4} {r['swaps']['ok']:>5} "
              f"{_fmt(r['swap_call_ms_p50']):>7} "
              f"{_fmt(r['drafter_visible_ms_p50']):>10} {_fmt(r['events_per_s']):>8} {_fmt(r['records_per_s']):>6}")
    print("(medians: swap ms = the admin call, visible ms = until a response shows the new drafter; events: the "
          "per-step records inside the segment records (rec) sent to Redis)")
    for group, ratios in result["ratios"].items():
        if group == "vllm_over_native":
            for scenario, values in ratios.items():
                print(f"vllm/native {scenario}: " + ", ".join(f"{m} {_fmt(v, '.2f')}" for m, v in values.items()))
        else:
            print(f"{group}: " + ", ".join(f"{name} {_fmt(v, '.2f')}" for name, v in ratios.items()))


def _print_prefix_table(reuse: dict) -> None:
    """The prefix-reuse rows (ms; the servers' prefix counters over each workload) and ratios."""
    print(f"{'backend':<7} {'scenario':<13} {'reuse':<5} {'TTFT p50':>9} {'8th first p50':>13} {'queries':>8} "
          f"{'hits':>7}")
    for r in reuse["rows"]:
        first = r.get("ttft_ms") or r.get("first_token_ms")
        eighth = (r.get("eighth_first_token_ms") or {}).get("p50")
        print(f"{r['backend']:<7} {r['scenario']:<13} {'on' if r['prefix_cache'] else 'off':<5} "
              f"{_fmt(first['p50']):>9} {_fmt(eighth):>13} {r['prefix_cache_queries']:>8.0f} "
              f"{r['prefix_cache_hits']:>7.0f}")
    print("(TTFT p50: shared_prefix's, for n8 its first choice's; 8th first: n8's last choice's first token)")
    for backend, values in reuse["ratios"].items():
        print(f"{backend} prefix reuse: " + ", ".join(
            f"{name} {_fmt(v['ratio'], '.3f')} (target <= {v['target']}, {'met' if v['met'] else 'NOT met'})"
            for name, v in values.items()))


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
        line = timelines[row["backend"], row["scenario"]]
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
        ax.set_title(f"{row['backend']} {row['scenario']}", fontsize="small", loc="left")
        ax.legend(fontsize="x-small", loc="upper right")
    ax.set_xlabel("seconds since the scenario's first request")
    bars = fig.add_subplot(grid[:, 1])
    names = [f"{r['backend']} {r['scenario']}" for r in rows]
    colors = {b: f"C{i}" for i, b in enumerate(dict.fromkeys(r["backend"] for r in rows))}
    drawn = bars.bar(names, [r["requests_per_s"] for r in rows], color=[colors[r["backend"]] for r in rows])
    for rect, r in zip(drawn, rows):
        bars.annotate(f"{r['tokens_per_s']:.0f} tok/s", (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                      ha="center", va="bottom", fontsize="small")
    bars.set_ylabel("requests/s")
    bars.tick_params(axis="x", labelrotation=60)
    bars.set_title(f"{result['model']}, {result['users']} users, {result['duration_s']:g} s each", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
