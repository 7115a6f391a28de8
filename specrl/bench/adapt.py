"""`specrl bench adapt`: does the drafter learn on live traffic, how fast, and does it pay?

One run per objective (plus a domain-shift run with --shift), each on its own deployment,
weights store (a temporary directory) and Redis stream:

    Redis (REDIS_URL, else an embedded Valkey, as `specrl up`) -> `specrl serve` (day-0 drafter)
    -> `specrl train-drafter --objective O --publish-every-s 30` (as `specrl up`; a run shorter
    than 4 min evaluates 8 times per run instead) -> `users` clients replaying the TRAIN split of
    the prompt mix through the chat API (greedy, 64 tokens) -> a checkpoint every ~3 min of traffic.

Checkpoint (at the start, between traffic phases, at the end): the clients finish their
in-flight requests and stop, the trainer is paused (SIGSTOP; the server then idles), and this
process measures, on held-out prompts (8 x 48 tokens, EOS honoured), the drafter the server is
running (the store's `current`, the day-0 head before any publish):
  - acceptance length at k = 4: 1 + accepted / drafting steps, greedy, batch up to 4;
  - tokens/s of the native engine with the adaptive controller vs plain decoding over one
    shared target, prompt by prompt alternately at B = 1 (ratio of the totals, and the median of
    the per-prompt ratios, which a load spike from another process moves less), and over all 8
    at B = 4 (first and last checkpoint only), with the fraction of identical outputs.
Then the trainer continues (SIGCONT) and so does the traffic. Measuring with the trainer paused
keeps the three processes from fighting over the cores; the price is that the loop stands still
while it measures, so every time below is on the traffic clock: wall time minus pauses.
The server and the trainer run with half the cores' torch threads each, and so do the
measurements (or `--threads`): more threads than free cores is many times slower on this CPU
when anything else runs, and ratios need the same threads on both sides, not all the cores.

Trainer throughput: records trained (trainer log, `event=evaluate ... records=N`, the last one)
per traffic second; stream records produced and delivered to the trainer per traffic second.

Lag from a request's completion to a published drafter that learned from it: a record's arrival
is its stream entry id (the Redis clock, ms; a request's last segment is written when it
completes). The bench polls the trainer group's last-delivered id every POLL_S seconds; a
record counts as trained at the first poll that shows it delivered (the trainer trains on what
it reads in the same iteration, before it evaluates), and its lag is the traffic-clock time to
the first publish (`event=publish` in the trainer log; the manifest's `created` is kept beside
it) after that poll. Held-out records (~10%, never trained) count as trained; a publish that
came less than POLL_S after a read can be missed (lag then overstated by one publish interval).

Shift: objective `objectives[0]`; half the traffic time chat prompts, then code prompts. Every
checkpoint measures on held-out code prompts; the drafter serving at the switch is the frozen
copy, measured beside the online one at the end (tokens/s online / frozen).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from bisect import bisect_left
from datetime import datetime
from pathlib import Path

import torch

from specrl.config import Settings
from specrl.errors import InvalidRequestError, SpecrlError
from specrl.traffic import Traffic

MIX = {"chat": 1, "code": 1, "math": 1, "structured": 1}
SHIFT = ("chat", "code")
MEASURE_EVERY_MIN = 3.0
PROMPTS = 8
NEW_TOKENS = 48
TRAFFIC_TOKENS = 64
FIXED_K = 4
POLL_S = 0.5
SERVED_EVERY_S = 5.0
CHILD_THREADS = max(1, (os.cpu_count() or 2) // 2)
LOG_LINE = re.compile(r"ts=(\S+ \S+) level=\S+ logger=\S+ msg=event=(evaluate|publish|rollback) (.*)")


def run_adapt_bench(settings: Settings, minutes: float, objectives: list[str], shift: bool, users: int,
                    out_dir: str | None) -> dict:
    """Run every objective (and the shift run); print a table; write bench-adapt.json and .png."""
    from specrl.assets import resolve_model
    from specrl.trainer.objectives import OBJECTIVES

    unknown = [o for o in objectives if o not in OBJECTIVES]
    if not objectives or unknown or minutes <= 0 or users < 1:
        raise InvalidRequestError(f"--objectives must name some of {', '.join(OBJECTIVES)} (got {objectives}), "
                                  "--minutes must be > 0 and --users >= 1")
    out = Path(out_dir) if out_dir else settings.home / "reports" / f"bench-adapt-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    resolve_model(settings.model, settings.home)
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads if settings.threads > 0 else CHILD_THREADS)
    try:
        _progress(f"loading {settings.model} for the measurements ({torch.get_num_threads()} threads)")
        result = _run_all(settings, minutes, objectives, shift, users, Meter(settings), out)
    finally:
        torch.set_num_threads(threads)
    _print_table(result)
    (out / "bench-adapt.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, out / "bench-adapt.png")
    print(f"report: {out / 'bench-adapt.json'}\nchart:  {out / 'bench-adapt.png'}")
    return result


def _run_all(settings: Settings, minutes: float, objectives: list[str], shift: bool, users: int, meter: "Meter",
             out: Path) -> dict:
    from specrl.up import Redis

    n = max(1, round(minutes / MEASURE_EVERY_MIN))
    day0 = [Phase(MIX, minutes * 60 / n)] * n
    runs = [RunSpec(objective, objective, day0, _heldout(MIX, settings.seed)) for objective in objectives]
    if shift:
        half = max(1, round(minutes / 2 / MEASURE_EVERY_MIN))
        phases = [Phase({SHIFT[0]: 1}, minutes * 30 / half)] * half + [Phase({SHIFT[1]: 1}, minutes * 30 / half)] * half
        runs.append(RunSpec(f"shift-{objectives[0]}", objectives[0], phases, _heldout({SHIFT[1]: 1}, settings.seed),
                            frozen_after=half))
    redis = Redis(settings.redis_url)
    try:
        reports = [Run(spec, settings, redis.url, meter, out / spec.name, users, minutes).execute() for spec in runs]
    finally:
        redis.stop()
    return _result(settings, minutes, objectives, shift, users, reports, redis_external=bool(settings.redis_url))


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


def _heldout(weights: dict, seed: int) -> list:
    """PROMPTS held-out prompts spread over the domains of `weights` (seeded, the same every run)."""
    from specrl.data import load_prompts

    domains = [d for d, w in weights.items() if w > 0]
    picked = [random.Random(f"bench-adapt/{seed}/{d}").sample(load_prompts(d, "heldout"), PROMPTS) for d in domains]
    return [p for group in zip(*picked) for p in group][:PROMPTS]


# ---- measuring in this process ---------------------------------------------------------------
class Meter:
    """The native engine over one target: plain, adaptive k (one engine per drafter measured side
    by side) and fixed k = FIXED_K; drafters are swapped in at a step boundary, as the server does."""

    def __init__(self, settings: Settings):
        from specrl.bench.engine import native_engines

        self.settings = settings.replace(drafter="day0", max_batch=4, max_seq_len=1024)
        self.plain, spec = native_engines(self.settings)
        self.target, self.tokenizer, self.day0 = spec.target, spec.tokenizer, spec.drafter
        self.adaptive = [spec]
        self.fixed = self._engine(fixed_draft_tokens=FIXED_K)
        self.warm = False

    def _engine(self, **changes):
        from specrl.serving.engine import Engine

        return Engine(self.target, self.tokenizer, self.settings.replace(**changes), drafter=self.day0)

    def encode(self, prompts: list) -> list[list[int]]:
        from specrl.data import as_messages

        return [list(self.tokenizer.apply_chat_template(as_messages(p), add_generation_prompt=True, tokenize=True,
                                                        return_dict=False)) for p in prompts]

    def drafter(self, store, version: str | None):
        """-> (version, drafter): a store version (verified), or the day-0 head for None."""
        from specrl.models.drafter import EagleDrafter

        if version is None:
            return "day0", self.day0
        return version, EagleDrafter.load(store.verify("drafter", version), self.target).eval()

    def measure(self, drafters: dict, prompts: list[list[int]], batch4: bool) -> dict:
        """drafters: label -> (version, EagleDrafter). -> {"plain": {b1, b4}, "drafters": {label: ...}}."""
        from specrl.spec.sampling import SamplingParams

        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
        while len(self.adaptive) < len(drafters):
            self.adaptive.append(self._engine())
        engines = dict(zip(drafters, self.adaptive))
        if not self.warm:
            for engine in (self.plain, self.fixed, *engines.values()):
                engine.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0))
            self.warm = True
        result = {"plain": {}, "drafters": {}}
        for label, (version, drafter) in drafters.items():
            _use(engines[label], version, drafter)
            result["drafters"][label] = {"version": version, **self._fixed_k(version, drafter, prompts, params)}
        self._batch1(engines, prompts, params, result)
        if batch4:
            plain = _Tally().add(*_run(self.plain, prompts, params))
            result["plain"]["b4"] = plain.speed()
            for label, engine in engines.items():
                b4 = result["drafters"][label]["b4"] = _Tally().add(*_run(engine, prompts, params), plain.outputs).speed()
                result["drafters"][label]["ratio_b4"] = b4["tokens_per_s"] / result["plain"]["b4"]["tokens_per_s"]
        return result

    def _fixed_k(self, version: str, drafter, prompts: list[list[int]], params) -> dict:
        """Acceptance length at k = FIXED_K (every prompt, batched up to max_batch)."""
        _use(self.fixed, version, drafter)
        seconds, done, stats = _run(self.fixed, prompts, params)
        return {"acceptance_length_k4": stats["acceptance_length"], "k4_tokens_per_s": stats["tokens"] / seconds}

    def _batch1(self, engines: dict, prompts: list[list[int]], params, result: dict) -> None:
        """B = 1, prompt by prompt: plain, then each adaptive engine, so that background load
        drifts hit every engine alike; also the median of the per-prompt speed ratios."""
        plain, tallies = _Tally(), {label: _Tally() for label in engines}
        ratios = {label: [] for label in engines}
        for prompt in prompts:
            seconds, [reference], stats = _run(self.plain, [prompt], params)
            plain.add(seconds, [reference], stats)
            for label, engine in engines.items():
                spec_s, [done], stats = _run(engine, [prompt], params)
                tallies[label].add(spec_s, [done], stats, [reference.output_ids])
                ratios[label].append(len(done.output_ids) / spec_s / (len(reference.output_ids) / seconds))
        result["plain"]["b1"] = plain.speed()
        for label, tally in tallies.items():
            b1 = result["drafters"][label]["b1"] = tally.speed()
            result["drafters"][label]["ratio_b1"] = b1["tokens_per_s"] / result["plain"]["b1"]["tokens_per_s"]
            result["drafters"][label]["ratio_b1_median"] = sorted(ratios[label])[len(prompts) // 2]


def _use(engine, version: str, drafter) -> None:
    """Swap `drafter` into `engine` at a step boundary (the engine is idle between measurements)."""
    from specrl.serving.swap import SwapRequest

    if engine.drafter is drafter:
        return
    request = SwapRequest("drafter", version, "drain", drafter, 0.0)
    engine.request_swap(request)
    engine.step()
    request.done.result(timeout=0)


def _run(engine, prompts: list[list[int]], params) -> tuple[float, list, dict]:
    """Generate; -> (seconds, completions, the engine's counters over the run)."""
    before = dataclasses.replace(engine.stats)
    started = time.perf_counter()
    done = engine.generate(prompts, params)
    seconds = time.perf_counter() - started
    after = engine.stats
    stats = {name: getattr(after, name) - getattr(before, name)
             for name in ("steps", "drafts", "draft_tokens", "accepted_tokens")}
    stats["tokens"] = sum(len(c.output_ids) for c in done)
    stats["acceptance_length"] = 1 + stats["accepted_tokens"] / stats["drafts"] if stats["drafts"] else None
    return seconds, done, stats


@dataclasses.dataclass
class _Tally:
    """Generation runs added up: time, tokens, engine counters, outputs equal to a reference."""

    seconds: float = 0.0
    counts: dict = dataclasses.field(default_factory=dict)
    outputs: list = dataclasses.field(default_factory=list)
    same: int = 0

    def add(self, seconds: float, done: list, stats: dict, reference: list | None = None) -> "_Tally":
        self.seconds += seconds
        for name in ("tokens", "steps", "drafts", "draft_tokens", "accepted_tokens"):
            self.counts[name] = self.counts.get(name, 0) + stats[name]
        outputs = [c.output_ids for c in done]
        self.same += sum(a == b for a, b in zip(outputs, reference or outputs))
        self.outputs += outputs
        return self

    def speed(self) -> dict:
        c = self.counts
        row = {"seconds": self.seconds, "tokens": c["tokens"], "tokens_per_s": c["tokens"] / self.seconds,
               "same_output": self.same / len(self.outputs)}
        row.update(tokens_per_step=c["tokens"] / c["steps"], mean_k=c["draft_tokens"] / c["steps"],
                   acceptance_length=1 + c["accepted_tokens"] / c["drafts"] if c["drafts"] else None)
        return row


# ---- one run: processes, traffic, checkpoints ------------------------------------------------
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

    def __init__(self, spec: RunSpec, settings: Settings, redis_url: str, meter: Meter, out: Path, users: int,
                 minutes: float):
        self.spec, self.settings, self.redis_url, self.meter, self.out = spec, settings, redis_url, meter, out
        self.deployment = f"bench-adapt-{spec.name}-{secrets.token_hex(4)}"
        self.users = users
        self.publish_every_s = max(5.0, min(30.0, minutes * 60 / 8))
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
            report.update(_trainer_report(self.out / "trainer.log", self.clock, self.store, report))
        return report

    def _start(self) -> None:
        from specrl.launch import free_port, spawn, wait_healthy

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "SPECRL_ADMIN_TOKEN": secrets.token_hex(16)}
        common = ["--model", self.settings.model, "--home", str(self.settings.home), "--redis-url", self.redis_url,
                  "--deployment", self.deployment, "--store", str(self.store.root), "--threads", str(CHILD_THREADS),
                  "--draft-vocab-size", str(self.settings.draft_vocab_size)]
        _progress(f"run={self.spec.name}: starting server and trainer (objective={self.spec.objective}, "
                  f"deployment={self.deployment}, logs in {self.out})")
        self.children["server"] = spawn(["serve", *common, "--host", "127.0.0.1", "--port", str(port), "--drafter",
                                          "day0", "--max-batch", str(self.settings.max_batch)], env,
                                         self.out / "server.log")
        wait_healthy(self.url, self.children["server"], self.out / "server.log")
        self.children["trainer"] = spawn(["train-drafter", *common, "--server", self.url, "--objective",
                                           self.spec.objective, "--publish-every-s", f"{self.publish_every_s:g}"],
                                          env, self.out / "trainer.log")
        _wait_for_line(self.children["trainer"], self.out / "trainer.log", "event=start")
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
                "heldout": [p.id for p in self.spec.heldout], "checkpoints": checkpoints, "frozen": self.frozen,
                "traffic": {"requests": traffic.requests, "completion_tokens": traffic.tokens,
                            "failures": traffic.failures}, "publish_every_s": self.publish_every_s,
                "logs": {"server": str(self.out / "server.log"), "trainer": str(self.out / "trainer.log")}}

    def _checkpoint(self, label: str, *, batch4: bool, traffic: Traffic | None = None, resume: bool = True) -> dict:
        self._pause()
        try:
            wall = self.clock.pauses[-1][0] if self.clock.pauses else time.time()
            drafters = {"online": self.meter.drafter(self.store, self.store.current("drafter"))}
            if self.frozen is not None and label == "end":
                drafters["frozen"] = self.meter.drafter(self.store, None if self.frozen == "day0" else self.frozen)
            _progress(f"run={self.spec.name}: checkpoint {label}: measuring "
                      + ", ".join(f"{k}={v[0]}" for k, v in drafters.items()))
            measured = self.meter.measure(drafters, self.prompts, batch4)
        finally:
            if resume:
                self._resume()
        events = _trainer_events(self.out / "trainer.log") if "trainer" in self.children else []
        trained = [e for e in events if e["event"] == "evaluate"]
        online = measured["drafters"]["online"]
        manifest = self.store.manifest("drafter", online["version"]) if online["version"] != "day0" else None
        row = {"label": label, "time_s": time.monotonic() - self.started, "traffic_s": self.clock(wall),
               "requests": traffic.requests if traffic else 0, "traffic_tokens": traffic.tokens if traffic else 0,
               "trainer_records": int(trained[-1]["records"]) if trained else 0,
               "drafter_records": int(manifest.metrics.get("records", 0)) if manifest else 0, **measured}
        _progress(f"run={self.spec.name}: checkpoint {label}: traffic {row['traffic_s'] / 60:.1f} min, "
                  f"drafter {online['version']}, acceptance length k=4 {_fmt(online['acceptance_length_k4'])}, "
                  f"B=1 {online['b1']['tokens_per_s']:.1f} vs plain {measured['plain']['b1']['tokens_per_s']:.1f} "
                  f"tok/s ({online['ratio_b1']:.2f}x)")
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
        from specrl.up import rates, sample_metrics

        client = redis.Redis.from_url(self.redis_url, decode_responses=True)
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
                    if previous is not None:
                        self.served.append({**sample, **rates(previous, sample)})
                    previous = sample

    def _collect(self) -> dict:
        """Arrival times of every record on the stream (entry ids), before the stream goes."""
        import redis

        client = redis.Redis.from_url(self.redis_url, protocol=2)  # payloads are msgpack: ids only are decoded
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
        from specrl.launch import terminate

        self.finished.set()
        self._resume()
        for name in ("trainer", "server"):
            if name in self.children:
                terminate(self.children[name])
        try:
            redis.Redis.from_url(self.redis_url).delete(self.stream, self.stream + DEAD_LETTER_SUFFIX)
        except redis.RedisError:
            pass
        shutil.rmtree(self.settings.home / "trainer" / self.deployment, ignore_errors=True)


def _wait_for_line(proc: subprocess.Popen, log: Path, needle: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if needle in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise SpecrlError(f"the trainer exited with {proc.returncode}; see {log}")
        time.sleep(0.5)
    raise SpecrlError(f"the trainer did not start in {timeout_s:.0f} s; see {log}")


def _entry_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


# ---- the trainer's side: log, manifests, throughput, lag -------------------------------------
def _trainer_events(log: Path) -> list[dict]:
    """`event=evaluate|publish|rollback` lines of the trainer log -> dicts with `time` (unix s)."""
    events = []
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        match = LOG_LINE.match(line)
        if match:
            stamp, event, rest = match.groups()
            fields = dict(re.findall(r"(\w+)=(\S+)", rest))
            events.append({"time": datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp(), "event": event,
                           **fields})
    return events


def _trainer_report(log: Path, clock: TrafficClock, store, run: dict) -> dict:
    end = run.pop("final_pause_wall")
    arrivals, polls = run.pop("arrivals"), run.pop("polls")
    events = [e for e in _trainer_events(log) if e["time"] <= end]
    for e in events:
        e["traffic_s"] = clock(e["time"])
    manifests = {m.version: m for m in store.versions("drafter")} if store.root.is_dir() else {}
    publishes = [e for e in events if e["event"] == "publish"]
    for p in publishes:
        m = manifests.get(p["version"])
        p["created"] = m.created if m else None
        p["records"] = m.metrics.get("records") if m else None
    evaluations = [e for e in events if e["event"] == "evaluate"]
    span = clock(end)
    trained = int(evaluations[-1]["records"]) if evaluations else 0
    delivered = sum(1 for a in arrivals if polls and a <= polls[-1][1])
    throughput = {"trained_records": trained,
                  "trained_records_per_s": trained / max(evaluations[-1]["traffic_s"], 1e-9) if trained else 0.0,
                  "stream_records": len(arrivals), "stream_records_per_s": len(arrivals) / span if span else 0.0,
                  "delivered_records": delivered, "delivered_records_per_s": delivered / span if span else 0.0,
                  "backlog_at_end": len(arrivals) - delivered, "traffic_s": span}
    backlog = [[round(clock(t), 1), lag] for t, _, lag in polls[::round(SERVED_EVERY_S / POLL_S)]]
    return {"evaluations": evaluations, "publishes": publishes, "backlog": backlog,
            "rollbacks": [e for e in events if e["event"] == "rollback"],
            "manifests": [m.to_dict() for m in manifests.values()], "throughput": throughput,
            "lag": _lag(arrivals, polls, [p["time"] for p in publishes], clock, end)}


def _lag(arrivals: list[tuple[int, int]], polls: list, publishes: list[float], clock: TrafficClock, end: float) -> dict:
    """Per record: traffic seconds from its arrival to the first publish after a poll saw it delivered."""
    lags, freshest, pending, j = [], {}, 0, 0
    for entry in sorted(arrivals):
        while j < len(polls) and polls[j][1] < entry:
            j += 1
        k = bisect_left(publishes, polls[j][0]) if j < len(polls) else len(publishes)
        if k == len(publishes):
            pending += 1
            continue
        lag = clock(publishes[k]) - clock(entry[0] / 1000)
        lags.append(lag)
        freshest[k] = min(freshest.get(k, math.inf), lag)
    lags.sort()
    stats = {"records": len(arrivals), "in_a_publish": len(lags), "not_yet_published": pending,
             "method": "stream entry id -> first group poll showing it delivered -> next event=publish; traffic clock"}
    if lags:
        stats.update(median_s=lags[len(lags) // 2], p90_s=lags[min(len(lags) - 1, int(0.9 * len(lags)))],
                     min_s=lags[0], mean_s=sum(lags) / len(lags),
                     freshest_per_publish_s=[freshest[k] for k in sorted(freshest)])
    return stats


# ---- report -----------------------------------------------------------------------------------
def _result(settings: Settings, minutes: float, objectives: list[str], shift: bool, users: int, runs: list[dict],
            redis_external: bool) -> dict:
    import transformers

    summary = {}
    for run in runs:
        first, last = run["checkpoints"][0], run["checkpoints"][-1]
        online = last["drafters"]["online"]
        entry = {"acceptance_length_k4": [first["drafters"]["online"]["acceptance_length_k4"],
                                          online["acceptance_length_k4"]],
                 "ratio_b1": [first["drafters"]["online"]["ratio_b1"], online["ratio_b1"]],
                 "ratio_b4": [first["drafters"]["online"].get("ratio_b4"), online.get("ratio_b4")],
                 "publishes": len(run["publishes"]), "trained_records_per_s": run["throughput"]["trained_records_per_s"],
                 "lag_median_s": run["lag"].get("median_s")}
        if "frozen" in last["drafters"]:
            frozen = last["drafters"]["frozen"]
            entry["online_over_frozen_b1"] = online["b1"]["tokens_per_s"] / frozen["b1"]["tokens_per_s"]
            entry["online_over_frozen_b4"] = (online["b4"]["tokens_per_s"] / frozen["b4"]["tokens_per_s"]
                                              if "b4" in online else None)
            entry["frozen_version"] = frozen["version"]
        summary[run["name"]] = entry
    return {
        "command": sys.argv, "timestamp": datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
        "child_threads": CHILD_THREADS, "model": settings.model,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(settings).items()},
        "minutes": minutes, "objectives": objectives, "shift": shift, "users": users,
        "redis": "REDIS_URL" if redis_external else "embedded valkey",
        "measurement": {"prompts": PROMPTS, "new_tokens": NEW_TOKENS, "fixed_k": FIXED_K, "traffic_tokens": TRAFFIC_TOKENS,
                        "measure_every_min": MEASURE_EVERY_MIN, "mix": MIX, "shift_domains": SHIFT,
                        "acceptance_length": "1 + accepted / drafting steps (tokens per verify step, bonus included)",
                        "interference": "traffic drained and the trainer SIGSTOPped during every measurement; "
                                        "times are on the traffic clock (pauses excluded)"},
        "summary": summary, "runs": runs,
    }


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _print_table(result: dict) -> None:
    print(f"{'run':<12} {'point':<8} {'min':>5} {'tokens':>7} {'trained':>7} {'drafter':>7} {'(recs)':>6} {'acc.k4':>6} "
          f"{'spec':>6} {'plain':>6} {'B1 x':>5} {'med x':>5} {'B4 x':>5}")
    for run in result["runs"]:
        for c in run["checkpoints"]:
            for label, d in c["drafters"].items():
                name = run["name"] + ("" if label == "online" else f" ({label})")
                print(f"{name:<12} {c['label']:<8} {c['traffic_s'] / 60:>5.1f} {c['traffic_tokens']:>7} "
                      f"{c['trainer_records']:>7} {d['version']:>7} {c['drafter_records'] if label == 'online' else '-':>6} "
                      f"{_fmt(d['acceptance_length_k4']):>6} "
                      f"{d['b1']['tokens_per_s']:>6.1f} {c['plain']['b1']['tokens_per_s']:>6.1f} "
                      f"{d['ratio_b1']:>5.2f} {d['ratio_b1_median']:>5.2f} {_fmt(d.get('ratio_b4')):>5}")
    for run in result["runs"]:
        t, lag = run["throughput"], run["lag"]
        print(f"{run['name']}: {len(run['publishes'])} publishes; trainer {t['trained_records_per_s']:.2f} records/s "
              f"trained, traffic {t['stream_records_per_s']:.2f} records/s, backlog at end {t['backlog_at_end']}; "
              f"lag completion -> published drafter median {_fmt(lag.get('median_s'))} s, p90 {_fmt(lag.get('p90_s'))} s "
              f"({lag['not_yet_published']} of {lag['records']} records not yet in a published drafter)")
        s = result["summary"][run["name"]]
        if "online_over_frozen_b1" in s:
            print(f"{run['name']}: online / frozen ({s['frozen_version']}) tokens/s on held-out "
                  f"{SHIFT[1]}: B=1 {s['online_over_frozen_b1']:.2f}x, B=4 {_fmt(s['online_over_frozen_b4'])}x")


def _plot(result: dict, path: Path) -> None:
    """Acceptance length and speed ratio over traffic time (publishes marked), acceptance length vs
    traffic tokens per objective, and the served acceptance length (or the shift comparison)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 8))
    (acc, ratio), (objectives, extra) = fig.subplots(2, 2)
    colors = [f"C{i}" for i in range(10)]
    for run, color in zip(result["runs"], colors):
        points = run["checkpoints"]
        minutes = [c["traffic_s"] / 60 for c in points]
        online = [c["drafters"]["online"] for c in points]
        acc.plot(minutes, [d["acceptance_length_k4"] or 1.0 for d in online], "o-", color=color, label=run["name"])
        evals = [e for e in run["evaluations"] if e.get("candidate_tau") not in (None, "None")]
        acc.plot([e["traffic_s"] / 60 for e in evals], [float(e["candidate_tau"]) for e in evals], ":", color=color,
                 alpha=0.6, label=f"{run['name']}: trainer's held-out tau")
        ratio.plot(minutes, [d["ratio_b1"] for d in online], "o-", color=color, label=f"{run['name']} B=1")
        b4 = [(m, d["ratio_b4"]) for m, d in zip(minutes, online) if "ratio_b4" in d]
        if b4:
            ratio.plot(*zip(*b4), "s--", color=color, mfc="none", label=f"{run['name']} B=4")
        for p in run["publishes"]:
            for ax in (acc, ratio):
                ax.axvline(p["traffic_s"] / 60, color=color, alpha=0.25, linewidth=0.8)
        if "frozen" not in points[-1]["drafters"]:
            objectives.plot([c["traffic_tokens"] / 1000 for c in points], [d["acceptance_length_k4"] or 1.0 for d in online],
                            "o-", color=color, label=run["objective"])
            if not result["shift"]:
                served = [s for s in run["served"] if s.get("acceptance_length")]
                extra.plot([s["traffic_s"] / 60 for s in served], [s["acceptance_length"] for s in served],
                           color=color, label=run["name"])
        else:
            last = points[-1]
            names = ["plain", "frozen", "online"]
            values = [last["plain"]["b1"]["tokens_per_s"], last["drafters"]["frozen"]["b1"]["tokens_per_s"],
                      last["drafters"]["online"]["b1"]["tokens_per_s"]]
            extra.bar([f"{n}\n{run['name']}" for n in names], values, color=["grey", "tab:blue", color])
            extra.set_ylabel(f"tokens/s B=1, held-out {SHIFT[1]}")
    acc.set(ylabel=f"acceptance length (k={FIXED_K}, held-out)", xlabel="traffic minutes (vertical: publishes)")
    ratio.axhline(1.0, color="black", linewidth=0.8)
    ratio.axhline(1.3, color="grey", linestyle=":", linewidth=0.8)
    ratio.set(ylabel="tokens/s adaptive / plain", xlabel="traffic minutes")
    objectives.set(ylabel=f"acceptance length (k={FIXED_K})", xlabel="traffic completion tokens (thousands)",
                   title="objectives")
    if not extra.get_ylabel():
        extra.set(ylabel="served acceptance length (live /metrics)", xlabel="traffic minutes")
    for ax in (acc, ratio, objectives, extra):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="x-small")
    fig.suptitle(f"bench adapt: {result['model']}, {result['minutes']:g} min of traffic per run, {result['users']} users")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
