"""`bench adapt`'s measurement side: the native engine over one target, run plain, with the
adaptive controller (one engine per drafter measured side by side) and at a fixed k, on held-out
prompts, outputs checked against plain decoding."""

from __future__ import annotations

import dataclasses
import statistics
import time

from specrl.config import Settings
from specrl.speculation.quantities import SpecCounts

FIXED_K = 4
NEW_TOKENS = 48
# B = 4 runs of every engine over all prompts, in alternating order. One run is ~3 s: measured
# once, an engine whose controller never drafted (k = 0 at every step) read 0.90x plain; over the
# totals of three rounds, plain read 227 tok/s beside a head that drafted 0.3% of steps at 360
# (the same engine in-process, unloaded: 348-412 both), so the ratio kept is the median over
# rounds of each round's ratio, which one disturbed run does not move, after one untimed run each.
B4_ROUNDS = 5


class Meter:
    """The native engine over one target, measured side by side: plain; per drafter (the online
    one, and a frozen copy when the run has one) the head alone ("online") and the head beside
    the suffix index ("online+suffix"); the suffix index alone ("suffix"); and the head at a fixed
    k = FIXED_K (its acceptance). Drafters are swapped in at a step boundary, as the server does.

    The suffix index is the run's traffic as another replica sees it: `index`, fed from the event
    stream by a `FleetFeed` the run starts (`reset_index` for each run). The measured requests
    never join it (`Engine.index_finished = False`), so no engine drafts from another's answers to
    the same held-out prompt."""

    def __init__(self, settings: Settings):
        from specrl.apps.bench.engine import native_engines

        self.settings = settings.replace(max_batch=4, max_seq_len=1024)
        self.plain, spec = native_engines(self.settings)
        self.target, self.tokenizer = spec.target, spec.tokenizer
        self.start = (spec.drafter_version, spec.drafter)  # the head the server starts on (--drafter)
        self.head = [self._engine(suffix_capacity=0)]
        self.hybrid = [spec]
        self.suffix = self._engine(with_head=False)
        self.fixed = self._engine(fixed_draft_tokens=FIXED_K, suffix_capacity=0)
        self.reset_index()
        self.warm = False

    def _engine(self, with_head: bool = True, **changes):
        from specrl.engine.engine import Engine

        return Engine(self.target, self.tokenizer, self.settings.replace(**changes),
                      drafter=self.start[1] if with_head else None, plan=self.plain.plan)

    def reset_index(self) -> None:
        """A new, empty shared suffix index for the engines that use one (a new run's traffic)."""
        from specrl.speculation.suffix_index import SuffixIndex

        self.index = SuffixIndex(self.settings.suffix_capacity)
        for engine in (self.plain, *self.head, *self.hybrid, self.suffix, self.fixed):
            self._share(engine)

    def _share(self, engine) -> None:
        """Engines with an index draft from the shared one; no engine adds its measured requests."""
        if engine.suffix is not None:
            engine.suffix = self.index
        engine.index_finished = False

    def encode(self, prompts: list) -> list[list[int]]:
        from specrl.data import chat_token_ids

        return chat_token_ids(self.tokenizer, prompts)

    def drafter(self, store, version: str | None):
        """-> (version, drafter): a store version (verified), or the head the server started on for None."""
        from specrl.models.drafter import EagleDrafter

        if version is None:
            return self.start
        drafter = EagleDrafter.load(store.verify("drafter", version), self.target).eval()
        return version, drafter.prepare_inference(self.plain.plan) if self.plain.plan is not None else drafter

    def measure(self, drafters: dict, prompts: list[list[int]], batch4: bool) -> dict:
        """drafters: label -> (version, EagleDrafter). -> {"plain": {b1, b4}, "drafters": {configuration:
        ...}} with configurations `label` (head alone), `label+suffix` and "suffix"."""
        from specrl.speculation.sampling import SamplingParams

        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
        while len(self.head) < len(drafters):
            self.head.append(self._engine(suffix_capacity=0))
            self.hybrid.append(self._engine())
            self._share(self.head[-1])
            self._share(self.hybrid[-1])
        engines, versions = {}, {}
        for i, (label, (version, drafter)) in enumerate(drafters.items()):
            engines[label], engines[label + "+suffix"] = self.head[i], self.hybrid[i]
            versions[label] = versions[label + "+suffix"] = version
            for engine in (self.head[i], self.hybrid[i]):
                _use(engine, version, drafter)
        engines["suffix"], versions["suffix"] = self.suffix, "none"
        if not self.warm:
            for engine in (self.plain, self.fixed, *engines.values()):
                engine.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0))
            self.warm = True
        result = {"plain": {}, "drafters": {name: {"version": versions[name]} for name in engines},
                  "index": {"documents": self.index.documents, "tokens": self.index.tokens}}
        for label, (version, drafter) in drafters.items():
            result["drafters"][label].update(self.fixed_k(version, drafter, prompts, params))
        self._batch1(engines, prompts, params, result)
        if batch4:
            self._batch4(engines, prompts, params, result)
        return result

    def fixed_k(self, version: str, drafter, prompts: list[list[int]], params) -> dict:
        """Mean acceptance length at k = FIXED_K (every prompt, batched up to max_batch)."""
        _use(self.fixed, version, drafter)
        seconds, done, stats = _run(self.fixed, prompts, params)
        return {"mean_acceptance_length_k4": stats.spec.mean_acceptance_length,
                "k4_tokens_per_s": stats.tokens / seconds}

    def _batch1(self, engines: dict, prompts: list[list[int]], params, result: dict) -> None:
        """B = 1, prompt by prompt: plain, then each engine, so that background load drifts hit
        every engine alike; also the median of the per-prompt speed ratios."""
        plain, tallies = _Tally(), {name: _Tally() for name in engines}
        ratios = {name: [] for name in engines}
        for prompt in prompts:
            seconds, [reference], stats = _run(self.plain, [prompt], params)
            plain.add(seconds, [reference], stats)
            for name, engine in engines.items():
                spec_s, [done], stats = _run(engine, [prompt], params)
                tallies[name].add(spec_s, [done], stats, [reference.output_ids])
                ratios[name].append(len(done.output_ids) / spec_s / (len(reference.output_ids) / seconds))
        _record(result, "b1", plain, tallies)
        for name in tallies:
            result["drafters"][name]["ratio_b1_median"] = sorted(ratios[name])[len(prompts) // 2]

    def _batch4(self, engines: dict, prompts: list[list[int]], params, result: dict) -> None:
        """B = 4 over all prompts: B4_ROUNDS rounds of plain and each engine, in alternating order
        (plain first, then last, ...), totals per engine, and per engine the median over rounds of
        its round's tokens/s over plain's; outputs checked against plain's first run."""
        plain, tallies = _Tally(), {name: _Tally() for name in engines}
        runs, reference = [(None, self.plain), *engines.items()], None
        rates: dict = {name: [] for name, _ in runs}
        for _, engine in runs:  # untimed: the first B = 4 run after traffic was the slow one, twice
            _run(engine, prompts[:4], params)
        for r in range(B4_ROUNDS):
            for name, engine in runs[:: 1 if r % 2 == 0 else -1]:
                seconds, done, counts = _run(engine, prompts, params)
                rates[name].append(counts.tokens / seconds)
                if name is None:
                    plain.add(seconds, done, counts)
                    reference = reference or [c.output_ids for c in done]
                else:
                    tallies[name].add(seconds, done, counts, reference)
        _record(result, "b4", plain, tallies)
        result["plain"]["b4"]["rounds_tokens_per_s"] = rates[None]
        for name in engines:
            result["drafters"][name]["b4"]["rounds_tokens_per_s"] = rates[name]
            result["drafters"][name]["ratio_b4_median"] = statistics.median(
                rate / base for rate, base in zip(rates[name], rates[None]))


def _record(result: dict, key: str, plain: "_Tally", tallies: dict) -> None:
    """Write plain's and each engine's speed under `key` ("b1", "b4"), with each engine's ratio to plain."""
    result["plain"][key] = plain.speed()
    for name, tally in tallies.items():
        speed = result["drafters"][name][key] = tally.speed()
        result["drafters"][name][f"ratio_{key}"] = speed["tokens_per_s"] / result["plain"][key]["tokens_per_s"]


def _use(engine, version: str, drafter) -> None:
    """Swap `drafter` into `engine` at a step boundary (the engine is idle between measurements)."""
    from specrl.engine.swap import SwapRequest

    if engine.drafter is drafter:
        return
    request = SwapRequest("drafter", version, "drain", drafter, 0.0)
    engine.request_swap(request)
    engine.step()
    request.done.result(timeout=0)


@dataclasses.dataclass
class _Counts:
    """What a generation run added to an engine's counters."""

    tokens: int
    spec: SpecCounts


def _run(engine, prompts: list[list[int]], params) -> tuple[float, list, _Counts]:
    """Generate; -> (seconds, completions, the engine's counters over the run)."""
    before = engine.stats.spec.copy()
    started = time.perf_counter()
    done = engine.generate(prompts, params)
    seconds = time.perf_counter() - started
    return seconds, done, _Counts(sum(len(c.output_ids) for c in done), engine.stats.spec.since(before))


@dataclasses.dataclass
class _Tally:
    """Generation runs added up: time, tokens, engine counters, outputs equal to a reference."""

    seconds: float = 0.0
    tokens: int = 0
    spec: SpecCounts = dataclasses.field(default_factory=SpecCounts)
    outputs: list = dataclasses.field(default_factory=list)
    same: int = 0

    def add(self, seconds: float, done: list, counts: _Counts, reference: list | None = None) -> "_Tally":
        self.seconds += seconds
        self.tokens += counts.tokens
        self.spec.add(counts.spec)
        outputs = [c.output_ids for c in done]
        self.same += sum(a == b for a, b in zip(outputs, reference or outputs))
        self.outputs += outputs
        return self

    def speed(self) -> dict:
        spec = self.spec
        return {"seconds": self.seconds, "tokens": self.tokens, "tokens_per_s": self.tokens / self.seconds,
                "same_output": self.same / len(self.outputs), "tokens_per_step": spec.tokens_per_step,
                "mean_k": spec.num_draft_tokens / spec.num_steps,
                "mean_acceptance_length": spec.mean_acceptance_length}


# ---- one run: processes, traffic, checkpoints ------------------------------------------------
