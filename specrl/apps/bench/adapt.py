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

from specrl.bench import adapt_report
from specrl.config import Settings
from specrl.errors import InvalidRequestError, SpecrlError
from specrl.traffic import Traffic
from specrl.trainer.drafter_log import trainer_events

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
    adapt_report.print_table(result)
    (out / "bench-adapt.json").write_text(json.dumps(result, indent=2) + "\n")
    adapt_report.plot(result, out / "bench-adapt.png")
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
    measurement = {"prompts": PROMPTS, "new_tokens": NEW_TOKENS, "fixed_k": FIXED_K, "traffic_tokens": TRAFFIC_TOKENS,
                   "measure_every_min": MEASURE_EVERY_MIN, "mix": MIX, "shift_domains": SHIFT,
                   "acceptance_length": "1 + accepted / drafting steps (tokens per verify step, bonus included)",
                   "interference": "traffic drained and the trainer SIGSTOPped during every measurement; "
                                   "times are on the traffic clock (pauses excluded)"}
    return adapt_report.build_result(settings, minutes, objectives, shift, users, reports, bool(settings.redis_url),
                                     measurement, CHILD_THREADS)


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
            report.update(adapt_report.trainer_report(self.out / "trainer.log", self.clock, self.store, report,
                                                      samples_every=round(SERVED_EVERY_S / POLL_S)))
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
        events = trainer_events(self.out / "trainer.log") if "trainer" in self.children else []
        trained = [e for e in events if e["event"] == "evaluate"]
        online = measured["drafters"]["online"]
        manifest = self.store.manifest("drafter", online["version"]) if online["version"] != "day0" else None
        row = {"label": label, "time_s": time.monotonic() - self.started, "traffic_s": self.clock(wall),
               "requests": traffic.requests if traffic else 0, "traffic_tokens": traffic.tokens if traffic else 0,
               "trainer_records": int(trained[-1]["records"]) if trained else 0,
               "drafter_records": int(manifest.metrics.get("records", 0)) if manifest else 0, **measured}
        _progress(f"run={self.spec.name}: checkpoint {label}: traffic {row['traffic_s'] / 60:.1f} min, "
                  f"drafter {online['version']}, acceptance length k=4 {adapt_report.fmt(online['acceptance_length_k4'])}, "
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
