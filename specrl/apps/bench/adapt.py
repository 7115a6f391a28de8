"""`specrl bench adapt`: does the drafter learn on live traffic, how fast, and does it pay?

One run per objective (plus a domain-shift run with --shift), each on its own deployment,
weights store (a temporary directory) and Redis stream:

    Redis (REDIS_URL, else an embedded Valkey, as `specrl up`) -> `specrl serve` (--drafter: the shipped head)
    -> `specrl train-drafter --objective O --publish-every-s 30` (as `specrl up`; a run shorter
    than 4 min evaluates 8 times per run instead) -> `users` clients replaying the TRAIN split of
    the prompt mix through the chat API (greedy, 64 tokens) -> a checkpoint every ~3 min of traffic.

Checkpoint (at the start, between traffic phases, at the end): the clients finish their
in-flight requests and stop, the trainer is paused (SIGSTOP; the server then idles), and this
process measures, on held-out prompts (8 x 48 tokens, EOS honoured), the drafter the server is
running (the store's `current`, the head it started on before any publish):
  - acceptance length at k = 4: 1 + accepted / drafting steps, greedy, batch up to 4;
  - tokens/s of the native engine with the adaptive controller vs plain decoding over one
    shared target, prompt by prompt alternately at B = 1 (ratio of the totals, and the median of
    the per-prompt ratios, which a load spike from another process moves less), and over all 8
    at B = 4 (first and last checkpoint only; five rounds, in alternating order: ratio of the
    totals, and the median of the per-round ratios), with the fraction of identical outputs;
  - who used the CPU meanwhile (`cpu_use`): this process, the server's and the trainer's process
    trees, the rest of the machine and the hypervisor (steal): a low reading with another
    process busy is a disturbed one.
Then the trainer continues (SIGCONT) and so does the traffic. Measuring with the trainer paused
keeps the three processes from fighting over the cores; the price is that the loop stands still
while it measures, so every time below is on the traffic clock: wall time minus pauses.
The server and the trainer run with half the cores' torch threads each, and so do the
measurements (or `--threads`): more threads than free cores is many times slower on this CPU
when anything else runs, and ratios need the same threads on both sides, not all the cores.

Trainer throughput: records trained (the trainer's event file, the last `evaluate` event's `records`)
per traffic second; stream records produced and delivered to the trainer per traffic second. Every
SERVED_EVERY_S the server's and the trainer's /metrics are sampled: served acceptance, the
trainer's production vs consumption rates and lag, and the effective-token yield (useful /
computed, specrl/telemetry/token_use.py) with its parts, over time (JSON `served`, PNG).

Lag from a request's completion to a published drafter that learned from it: a record's arrival
is its stream entry id (the Redis clock, ms; a request's last segment is written when it
completes). The bench polls the trainer group's last-delivered id every POLL_S seconds; a
record counts as trained at the first poll that shows it delivered (the trainer trains on what
it reads in the same iteration, before it evaluates), and its lag is the traffic-clock time to
the first publish (`publish` events in the trainer's event file; the manifest's `created` is kept beside
it) after that poll. Held-out records (~10%, never trained) count as trained; a publish that
came less than POLL_S after a read can be missed (lag then overstated by one publish interval).

Shift: objective `objectives[0]`; half the traffic time chat prompts, then code prompts. Every
checkpoint measures on held-out code prompts; the drafter serving at the switch is the frozen
copy, measured beside the online one at the end (tokens/s online / frozen).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from specrl.apps.bench import adapt_report, cpu_use, llamacpp
from specrl.apps.bench.adapt_meter import FIXED_K, NEW_TOKENS, Meter
from specrl.apps.bench.backends import machine_record
from specrl.apps.flags import COMMON, add_settings, settings_from
from specrl.apps.traffic import Traffic
from specrl.config import Settings
from specrl.errors import InvalidRequestError, SpecrlError
from specrl.redis_conn import connect
from specrl.models.calibration import cpu_info
from specrl.telemetry.event_log import read_events
from specrl.telemetry.fleet import FleetFeed

MIX = {"chat": 1, "code": 1, "math": 1, "structured": 1}
SHIFT = ("chat", "code")
MEASURE_EVERY_MIN = 3.0
PROMPTS = 8
TRAFFIC_TOKENS = 64
POLL_S = 0.5
SERVED_EVERY_S = 5.0
CHILD_THREADS = max(1, (os.cpu_count() or 2) // 2)
LLAMACPP_DTYPES = ("int8", "q4")  # llama.cpp's fastest formats (Q8_0, Q4_1): its best is the faster of the two


def register(sub) -> None:
    p = sub.add_parser("adapt", help="the drafter learning on live traffic: acceptance and speed over time, "
                                     "domain shift, objectives")
    p.add_argument("--minutes", type=float, default=10.0, help="minutes of traffic per run")
    p.add_argument("--objectives", default="kl", help="comma-separated: kl,kl_neg,pg (one run each)")
    p.add_argument("--shift", action="store_true", help="also run the domain-shift experiment")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--llamacpp", action="store_true",
                   help="also run llama.cpp on the held-out prompts after the runs (its Q8_0 and Q4_1, B=1 and B=4) "
                        "and compare the last checkpoint's tokens/s with its best")
    p.add_argument("--llamacpp-bin", default=None, metavar="DIR",
                   help="llama.cpp's binaries for --llamacpp (default: built once into <home>/llamacpp)")
    p.add_argument("--out", default=None, help="report directory (default <home>/reports/bench-adapt-<time>)")
    add_settings(p, *COMMON, "model", "dtype", "drafter", "draft_vocab_size", "redis_url", "publish_every_s")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    objectives = [o for o in args.objectives.split(",") if o]
    run_adapt_bench(settings_from(args).with_env_redis(), minutes=args.minutes, objectives=objectives,
                    shift=args.shift, users=args.users, out_dir=args.out,
                    llamacpp_bin=args.llamacpp_bin, with_llamacpp=args.llamacpp or bool(args.llamacpp_bin))
    return 0


def run_adapt_bench(settings: Settings, minutes: float, objectives: list[str], shift: bool, users: int,
                    out_dir: str | None, llamacpp_bin: str | None = None, with_llamacpp: bool = False) -> dict:
    """Run every objective (and the shift run); print a table; write bench-adapt.json and .png.
    with_llamacpp: llama.cpp's binaries (`llamacpp_bin`, else built into the cache home before the runs) measured
    on the same held-out prompts after them."""
    from specrl.assets import resolve_model
    from specrl.trainer.objectives import OBJECTIVES

    unknown = [o for o in objectives if o not in OBJECTIVES]
    if not objectives or unknown or minutes <= 0 or users < 1:
        raise InvalidRequestError(f"--objectives must name some of {', '.join(OBJECTIVES)} (got {objectives}), "
                                  "--minutes must be > 0 and --users >= 1")
    builds = llamacpp.builds(settings.home, llamacpp_bin, cpu_info()[1]) if with_llamacpp else []
    if with_llamacpp and not builds:
        _progress("no llama.cpp build: its rows are left out")
    out = Path(out_dir) if out_dir else settings.home / "reports" / f"bench-adapt-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    resolve_model(settings.model, settings.home)
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads if settings.threads > 0 else CHILD_THREADS)
    try:
        _progress(f"loading {settings.model} for the measurements ({torch.get_num_threads()} threads)")
        result = _run_all(settings, minutes, objectives, shift, users, Meter(settings), out, builds)
    finally:
        torch.set_num_threads(threads)
    adapt_report.print_table(result)
    (out / "bench-adapt.json").write_text(json.dumps(result, indent=2) + "\n")
    adapt_report.plot(result, out / "bench-adapt.png")
    print(f"report: {out / 'bench-adapt.json'}\nchart:  {out / 'bench-adapt.png'}")
    return result


def _run_all(settings: Settings, minutes: float, objectives: list[str], shift: bool, users: int, meter: "Meter",
             out: Path, builds: list) -> dict:
    from specrl.apps.redis_server import RedisServer

    n = max(1, round(minutes / MEASURE_EVERY_MIN))
    day0 = [Phase(MIX, minutes * 60 / n)] * n
    runs = [RunSpec(objective, objective, day0, heldout_prompts(MIX, settings.seed)) for objective in objectives]
    if shift:
        half = max(1, round(minutes / 2 / MEASURE_EVERY_MIN))
        phases = [Phase({SHIFT[0]: 1}, minutes * 30 / half)] * half + [Phase({SHIFT[1]: 1}, minutes * 30 / half)] * half
        runs.append(RunSpec(f"shift-{objectives[0]}", objectives[0], phases,
                            heldout_prompts({SHIFT[1]: 1}, settings.seed),
                            frozen_after=half))
    machine = {"start": machine_record()}
    redis = RedisServer(settings.redis_url)
    try:
        reports = [Run(spec, settings, redis.url, meter, out / spec.name, users).execute() for spec in runs]
    finally:
        redis.stop()
    beside = _llamacpp_beside(settings, builds, meter.encode(runs[0].heldout)) if builds else None
    machine["end"] = machine_record()
    measurement = {"prompts": PROMPTS, "new_tokens": NEW_TOKENS, "fixed_k": FIXED_K, "traffic_tokens": TRAFFIC_TOKENS,
                   "measure_every_min": MEASURE_EVERY_MIN, "mix": MIX, "shift_domains": SHIFT,
                   "mean_acceptance_length": "1 + accepted / drafting steps (specrl.speculation.quantities)",
                   "interference": "traffic drained and the trainer SIGSTOPped during every measurement; "
                                   "times are on the traffic clock (pauses excluded)"}
    return adapt_report.build_result(settings, minutes, objectives, shift, users, reports, bool(settings.redis_url),
                                     measurement, CHILD_THREADS, machine, beside)


def _llamacpp_beside(settings: Settings, builds: list, prompts: list[list[int]]) -> dict:
    """llama.cpp on the held-out prompts' mean length, NEW_TOKENS new tokens, at B = 1 and 4, with the
    measurement's threads, in each quantized type it has (its fastest formats): rows as bench engine's. Run after
    the runs, with the server and trainer stopped, so nothing else competes for the cores."""
    _progress(f"llama.cpp beside the last checkpoint: builds {', '.join(b.name for b in builds)}")
    prompt_tokens = llamacpp.mean_prompt_tokens(prompts)
    rows = llamacpp.llamacpp_rows(settings.home, builds, LLAMACPP_DTYPES, {d: "_" + d for d in LLAMACPP_DTYPES},
                                  [1, 4], prompt_tokens, NEW_TOKENS, torch.get_num_threads())
    return {"version": f"{llamacpp.SDIST[0]} {llamacpp.SDIST[1]}", "builds": {b.name: str(b.bin_dir) for b in builds},
            "prompt_tokens": prompt_tokens, "new_tokens": NEW_TOKENS, "rows": rows}


def _progress(message: str) -> None:
    print(f"bench adapt: {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Phase:
    weights: dict  # domain -> weight of the train-split prompt mix
    seconds: float


@dataclasses.dataclass(frozen=True)
class RunSpec:
    name: str
    objective: str
    phases: list[Phase]
    heldout: list  # Prompt
    frozen_after: int | None = None  # shift run: the drafter serving after this phase is frozen


def heldout_prompts(weights: dict, seed: int) -> list:
    """PROMPTS held-out prompts spread over the domains of `weights` (seeded, the same every run)."""
    from specrl.data import load_prompts

    domains = [d for d, w in weights.items() if w > 0]
    picked = [random.Random(f"bench-adapt/{seed}/{d}").sample(load_prompts(d, "heldout"), PROMPTS) for d in domains]
    return [p for group in zip(*picked) for p in group][:PROMPTS]


# ---- measuring in this process ---------------------------------------------------------------
class TrafficClock:
    """Traffic seconds since the traffic started, pauses (checkpoints) excluded."""

    def __init__(self):
        self.start: float | None = None
        self.pauses: list[list] = []  # [wall start, wall end or None]

    def __call__(self, wall: float) -> float:
        if self.start is None:
            return 0.0
        paused = sum(max(0.0, min(end or wall, wall) - max(start, self.start)) for start, end in self.pauses)
        return max(0.0, wall - self.start - paused)


class Run:
    """One deployment: server + trainer processes, traffic phases, a checkpoint after each."""

    def __init__(self, spec: RunSpec, settings: Settings, redis_url: str, meter: Meter, out: Path, users: int):
        self.spec, self.settings, self.redis_url, self.meter, self.out = spec, settings, redis_url, meter, out
        self.deployment = f"bench-adapt-{spec.name}-{secrets.token_hex(4)}"
        self.events_path = out / "trainer-events.jsonl"
        self.users = users
        self.clock = TrafficClock()
        self.polls: list[tuple[float, tuple[int, int], int | None]] = []  # wall, last delivered id, lag
        self.served: list[dict] = []
        self.started = time.monotonic()
        self.prompts = meter.encode(spec.heldout)
        self.children: dict[str, subprocess.Popen] = {}
        self.paused = threading.Event()
        self.finished = threading.Event()
        self.frozen: str | None = None  # shift run: the version serving at the switch

    def execute(self) -> dict:
        from specrl.telemetry import events_stream
        from specrl.weights import WeightsStore

        self.out.mkdir(parents=True, exist_ok=True)
        self.stream = events_stream(self.deployment)
        with tempfile.TemporaryDirectory(prefix="specrl-bench-adapt-") as tmp:
            self.store = WeightsStore(Path(tmp) / "store")
            try:
                self._start()
                report = self._phases()
                report.update(self._collect())
            finally:
                self._stop()
            report.update(adapt_report.trainer_report(self.events_path, self.clock, self.store, report,
                                                      samples_every=round(SERVED_EVERY_S / POLL_S)))
        return report

    def _start(self) -> None:
        from specrl.apps.launch import free_port, spawn, start_server
        from specrl.apps.scrape import engine_info

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        # the server and the trainer start on the same head (train-drafter takes it from the environment)
        env = {**os.environ, "SPECRL_ADMIN_TOKEN": secrets.token_hex(16), "SPECRL_DRAFTER": self.settings.drafter}
        common = ["--model", self.settings.model, "--home", str(self.settings.home), "--redis-url", self.redis_url,
                  "--deployment", self.deployment, "--store", str(self.store.root), "--threads", str(CHILD_THREADS),
                  "--draft-vocab-size", str(self.settings.draft_vocab_size)]
        _progress(f"run={self.spec.name}: starting server and trainer (objective={self.spec.objective}, "
                  f"deployment={self.deployment}, logs in {self.out})")
        self.children["server"], _ = start_server([*common, "--dtype", self.settings.dtype, "--drafter", self.settings.drafter,
                                                   "--max-batch", str(self.settings.max_batch)], env,
                                                  self.out / "server.log", port=port)
        self.engine = engine_info(self.url)
        self.meter.reset_index()  # the meter's suffix index learns this run's traffic as another replica would
        self.feed = FleetFeed(self.redis_url, self.stream, "bench-meter", self.meter.index,
                              deployment=self.deployment).start()
        self.trainer_url = f"http://127.0.0.1:{free_port()}"
        self.children["trainer"] = spawn(["train-drafter", *common, "--server", self.url, "--objective",
                                           self.spec.objective,
                                           "--publish-every-s", f"{self.settings.publish_every_s:g}",
                                           "--trainer-events", str(self.events_path),
                                           "--metrics-port", self.trainer_url.rpartition(":")[2]], env,
                                          self.out / "trainer.log")
        _wait_for_start(self.children["trainer"], self.events_path, self.out / "trainer.log")
        threading.Thread(target=self._poll, daemon=True).start()

    def _phases(self) -> dict:
        from specrl.data import PromptMix

        checkpoints = [self._checkpoint("start", batch4=True)]
        traffic = Traffic(self.url, self.settings.model, self.users, TRAFFIC_TOKENS)
        mixes: dict[str, PromptMix] = {}
        self.clock.start = time.time()
        for i, phase in enumerate(self.spec.phases):
            key = json.dumps(phase.weights, sort_keys=True)
            mix = mixes.setdefault(key, PromptMix(phase.weights, split="train", seed=self.settings.seed))
            _progress(f"run={self.spec.name}: traffic {'+'.join(phase.weights)} for {phase.seconds:.0f} s "
                      f"({self.users} users)")
            traffic.serve(mix, phase.seconds, tick=self._check_children)
            last = i == len(self.spec.phases) - 1
            checkpoints.append(self._checkpoint("end" if last else f"phase-{i + 1}", batch4=last, traffic=traffic,
                                                resume=not last))
            if self.spec.frozen_after == i + 1:
                self.frozen = checkpoints[-1]["drafters"]["online"]["version"]
        return {"name": self.spec.name, "objective": self.spec.objective, "deployment": self.deployment,
                "phases": [dataclasses.asdict(p) for p in self.spec.phases],
                "heldout": [p.id for p in self.spec.heldout], "server_engine": self.engine,
                "checkpoints": checkpoints, "frozen": self.frozen,
                "traffic": {"requests": traffic.requests, "completion_tokens": traffic.tokens,
                            "failures": traffic.failures}, "publish_every_s": self.settings.publish_every_s,
                "logs": {"server": str(self.out / "server.log"), "trainer": str(self.out / "trainer.log")}}

    def _checkpoint(self, label: str, *, batch4: bool, traffic: Traffic | None = None, resume: bool = True) -> dict:
        self._pause()
        try:
            wall = self.clock.pauses[-1][0] if self.clock.pauses else time.time()
            drafters = {"online": self.meter.drafter(self.store, self.store.current("drafter"))}
            if self.frozen is not None and label == "end":
                drafters["frozen"] = self.meter.drafter(self.store, None if self.frozen == self.meter.start[0] else self.frozen)
            _progress(f"run={self.spec.name}: checkpoint {label}: measuring "
                      + ", ".join(f"{k}={v[0]}" for k, v in drafters.items()))
            pids = {"meter": os.getpid(), **{name: child.pid for name, child in self.children.items()}}
            before = cpu_use.snapshot(pids)
            measured = self.meter.measure(drafters, self.prompts, batch4)
            measured["cpu"] = cpu_use.use(before, cpu_use.snapshot(pids))
        finally:
            if resume:
                self._resume()
        trained = read_events(self.events_path, "evaluate") if "trainer" in self.children else []
        online = measured["drafters"]["online"]
        manifest = self.store.manifest("drafter", online["version"]) if online["version"] != self.meter.start[0] else None
        row = {"label": label, "time_s": time.monotonic() - self.started, "traffic_s": self.clock(wall),
               "requests": traffic.requests if traffic else 0, "traffic_tokens": traffic.tokens if traffic else 0,
               "trainer_records": int(trained[-1]["records"]) if trained else 0,
               "drafter_records": int(manifest.metrics.get("records", 0)) if manifest else 0, **measured}
        _progress(f"run={self.spec.name}: checkpoint {label}: traffic {row['traffic_s'] / 60:.1f} min, "
                  f"drafter {online['version']}, acceptance length k=4 {adapt_report.fmt(online['mean_acceptance_length_k4'])}, "
                  f"B=1 {online['b1']['tokens_per_s']:.1f} vs plain {measured['plain']['b1']['tokens_per_s']:.1f} "
                  f"tok/s ({online['ratio_b1']:.2f}x); {cpu_use.describe(row['cpu'])}")
        return row

    def _pause(self) -> None:
        if "trainer" in self.children and not self.paused.is_set():
            self.paused.set()
            self.children["trainer"].send_signal(signal.SIGSTOP)
            self.clock.pauses.append([time.time(), None])

    def _resume(self) -> None:
        if "trainer" in self.children and self.paused.is_set():
            self.children["trainer"].send_signal(signal.SIGCONT)
            self.clock.pauses[-1][1] = time.time()
            self.paused.clear()

    def _check_children(self) -> None:
        for name, child in self.children.items():
            if child.poll() is not None:
                raise SpecrlError(f"the {name} exited with {child.returncode}; see {self.out / (name + '.log')}")

    def _poll(self) -> None:
        """Every POLL_S: the trainer group's last-delivered id and lag; every SERVED_EVERY_S: /metrics."""
        import redis

        from specrl.trainer.main import GROUP
        from specrl.apps.scrape import rates, sample_metrics, sample_trainer, yield_of

        client = connect(self.redis_url, decode_responses=True)
        previous, next_served = None, 0.0
        while not self.finished.wait(POLL_S):
            if self.paused.is_set():
                continue
            try:
                for info in client.xinfo_groups(self.stream):
                    if info["name"] == GROUP:
                        self.polls.append((time.time(), _entry_id(info["last-delivered-id"]), info.get("lag")))
            except redis.RedisError:
                pass
            if self.clock.start is not None and time.monotonic() >= next_served:
                next_served = time.monotonic() + SERVED_EVERY_S
                sample = sample_metrics(self.url, self.started)
                if sample is not None:
                    sample["traffic_s"] = self.clock(time.time())
                    sample["trainer"] = sample_trainer(self.trainer_url)
                    sample["yield"] = yield_of(sample, sample["trainer"])
                    if previous is not None:
                        self.served.append({**sample, **rates(previous, sample)})
                    previous = sample

    def _collect(self) -> dict:
        """Arrival times of every record on the stream (entry ids), before the stream goes."""
        client = connect(self.redis_url, protocol=2)  # payloads are msgpack: ids only are decoded
        arrivals, cursor = [], "-"
        while True:
            entries = [(i.decode(), f) for i, f in client.xrange(self.stream, min=cursor, max="+", count=500)]
            arrivals += [_entry_id(entry_id) for entry_id, _ in entries if entry_id != cursor]
            if len(entries) < 500:
                break
            cursor = entries[-1][0]
        return {"arrivals": arrivals, "polls": list(self.polls), "served": self.served,
                "final_pause_wall": self.clock.pauses[-1][0] if self.clock.pauses else time.time()}

    def _stop(self) -> None:
        import redis

        from specrl.telemetry.reader import DEAD_LETTER_SUFFIX
        from specrl.apps.launch import terminate

        self.finished.set()
        self._resume()
        if getattr(self, "feed", None) is not None:
            self.feed.stop()
        for name in ("trainer", "server"):
            if name in self.children:
                terminate(self.children[name])
        try:
            connect(self.redis_url).delete(self.stream, self.stream + DEAD_LETTER_SUFFIX)
        except redis.RedisError:
            pass
        shutil.rmtree(self.settings.home / "trainer" / self.deployment, ignore_errors=True)


def _wait_for_start(proc: subprocess.Popen, events: Path, log: Path, timeout_s: float = 300) -> None:
    """Until the trainer's event file says it started (its model is loaded, its group exists)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if read_events(events, "start"):
            return
        if proc.poll() is not None:
            raise SpecrlError(f"the trainer exited with {proc.returncode}; see {log}")
        time.sleep(0.5)
    raise SpecrlError(f"the trainer did not start in {timeout_s:.0f} s; see {log}")


def _entry_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
