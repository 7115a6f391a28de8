"""`specrl bench learn`: held-out acceptance a day-0 drafter gains per trained token and per
CPU-second, trained on shipped vs recomputed target features, for each objective.

1. Traffic, recorded once and cached by model version under <home>/bench-learn/<model sha>-<settings
   hash>/traffic.msgpack: `--prompts` prompts of the bundled mix (train split) and `--heldout` of
   the held-out split (chat template), greedy, `--max-tokens` each, through the native engine with
   the day-0 drafter at a fixed k = 4 (so that the records carry drafts, rejections and accepted
   lengths for kl_neg and pg) and no prefix cache (every record carries its whole prompt's
   features), into a memory sink that takes the target's features: the segment records are the
   traffic, exactly what a server would stream.
2. Per objective x feature source, a fresh day-0 drafter (the same seed) is trained by the drafter
   trainer itself (`DrafterTrainer.train`, its loss and optimizer; no Redis) on the training
   records in stream order, `train_records` examples per optimizer step, epoch after epoch, until
   `--minutes` CPU-minutes of training: the process's CPU time (`time.process_time`, every thread),
   evaluation excluded. Sources: "shipped" (the records' float16 features: the trainer loads only
   the target's head) and "recomputed" (the trainer's own copy of the target runs every context,
   as it does for records without features).
3. Every `--eval-every` CPU-seconds of training and at the end: held-out acceptance length (k = 4,
   exact greedy simulation, specrl/speculation/simulate.py `simulate_greedy`, tokens per verify step)
   over the held-out requests, from their shipped features (the same for every run), and the
   per-position acceptance rates of a k = 4 draft at every held-out position (the first one is the
   first-token acceptance).
Runs: objectives x sources x draft vocabularies (`--vocabularies`: `first8192`, the first ids as a
day-0 drafter takes them; `frequent8192`, the ids the target itself generates most often in the
recorded training traffic; `all`, the target's whole head). `--resume DIR` continues every run of an
earlier report for `--minutes` more (its drafter, optimizer and curve were saved there), so one
long curve is measured in pieces.
JSON (the command, versions, settings, every curve) and a PNG: acceptance length against trained
tokens and against training CPU-seconds, one line per run; a table at the end with ratios.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import sys
import tempfile
import time
from collections import Counter, deque
from pathlib import Path

import msgpack
import torch

from specrl.apps.bench.backends import machine_line
from specrl.apps.flags import COMMON, add_settings, settings_from
from specrl.config import Settings
from specrl.errors import InvalidRequestError
from specrl.models.llama import LlamaConfig

MIX = {"chat": 1, "code": 1, "math": 1, "structured": 1}
SOURCES = ("shipped", "recomputed")
FIXED_K = 4
RECORD_BATCH = 8  # requests the recording engine runs at once


def register(sub) -> None:
    p = sub.add_parser("learn", help="held-out acceptance vs trained tokens and CPU-seconds: shipped vs recomputed "
                                     "features, per objective, on a fixed recorded traffic set")
    p.add_argument("--minutes", type=float, default=5.0, help="training CPU-minutes per run")
    p.add_argument("--objectives", default="kl,kl_neg,pg", help="comma-separated: kl,kl_neg,pg")
    p.add_argument("--sources", default=",".join(SOURCES), help="comma-separated: shipped,recomputed")
    p.add_argument("--prompts", type=int, default=256, help="training prompts recorded")
    p.add_argument("--heldout", type=int, default=32, help="held-out prompts recorded")
    p.add_argument("--max-tokens", type=int, default=128, help="greedy tokens per recorded prompt")
    p.add_argument("--eval-every", type=float, default=30.0, help="CPU-seconds of training between evaluations")
    p.add_argument("--vocabularies", default=None,
                   help="comma-separated draft vocabularies: firstN (the first N ids), frequentN (the N ids the target "
                        "generates most often in the recorded traffic), all (default: --draft-vocab-size's firstN)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue every run of the report in DIR for --minutes more (its settings and traffic)")
    p.add_argument("--out", default=None, help="report directory (default <home>/reports/bench-learn-<time>)")
    add_settings(p, *COMMON, "model", "dtype", "draft_vocab_size", "train_records", "train_positions", "lr",
                 "unroll_steps", "seed", "record_features_max_bytes")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    if args.resume:
        resume_learn_bench(settings, Path(args.resume), minutes=args.minutes, eval_every_s=args.eval_every)
        return 0
    run_learn_bench(settings, minutes=args.minutes, objectives=_names(args.objectives),
                    sources=_names(args.sources), prompts=args.prompts, heldout=args.heldout,
                    max_tokens=args.max_tokens, eval_every_s=args.eval_every, out_dir=args.out,
                    vocabularies=_names(args.vocabularies or ""))
    return 0


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def run_learn_bench(settings: Settings, *, minutes: float, objectives: list[str], sources: list[str], prompts: int,
                    heldout: int, max_tokens: int, eval_every_s: float, out_dir: str | None,
                    vocabularies: list[str] | None = None) -> dict:
    """Record (or load) the traffic, train every objective x source x vocabulary (none given: the settings'
    draft_vocab_size's), print a table, write JSON + PNG."""
    from specrl.apps.bench.backends import machine_record, settings_record
    from specrl.assets import resolve_model
    from specrl.trainer.objectives import OBJECTIVES

    vocabularies = vocabularies or _names(default_vocabulary(settings.draft_vocab_size))
    if (not objectives or set(objectives) - set(OBJECTIVES) or not sources or set(sources) - set(SOURCES)
            or minutes <= 0 or prompts < 1 or heldout < 1 or max_tokens < 1 or eval_every_s <= 0):
        raise InvalidRequestError(f"--objectives must name some of {', '.join(OBJECTIVES)}, --sources some of "
                                  f"{', '.join(SOURCES)}; --minutes, --prompts, --heldout, --max-tokens and "
                                  "--eval-every must be > 0")
    model_dir = resolve_model(settings.model, settings.home)
    vocab_size = LlamaConfig.from_dir(model_dir).vocab_size
    for name in vocabularies:
        parse_vocabulary(name, vocab_size)
    out = Path(out_dir) if out_dir else settings.home / "reports" / f"bench-learn-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    machine = {"start": machine_record()}
    traffic = record_traffic(settings, model_dir, prompts, heldout, max_tokens)
    counts = generated_counts(traffic["train"], vocab_size)
    runs = [train_run(settings, model_dir, traffic, objective, source, minutes, eval_every_s,
                      vocabulary=vocabulary, counts=counts, state_dir=out)
            for objective in objectives for source in sources for vocabulary in vocabularies]
    machine["end"] = machine_record()
    result = {"command": [sys.argv], "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "model": settings.model, "machine": [machine],
              "settings": settings_record(settings),
              "minutes": minutes, "eval_every_s": eval_every_s, "eval_k": FIXED_K,
              "traffic": {k: v for k, v in traffic.items() if k not in ("train", "heldout")},
              "measurement": MEASUREMENT, "runs": runs, "summary": summarize(runs)}
    return _write(result, out)


def resume_learn_bench(settings: Settings, report_dir: Path, *, minutes: float, eval_every_s: float) -> dict:
    """Continue every run of the report in report_dir for `minutes` more CPU-minutes, from the drafter and
    optimizer it saved, on the same traffic (recorded with the report's settings) -> the report, extended."""
    from specrl.apps.bench.backends import machine_record
    from specrl.assets import resolve_model

    path = report_dir / "bench-learn.json"
    try:
        result = json.loads(path.read_text())
        saved = result["traffic"]
    except (OSError, ValueError, KeyError) as exc:
        raise InvalidRequestError(f"--resume {report_dir}: not a bench learn report ({exc})") from None
    if minutes <= 0 or eval_every_s <= 0:
        raise InvalidRequestError("--minutes and --eval-every must be > 0")
    settings = settings.replace(**{k: result["settings"][k] for k in RESUMED_SETTINGS if k in result["settings"]})
    model_dir = resolve_model(settings.model, settings.home)
    machine = {"start": machine_record()}
    traffic = record_traffic(settings, model_dir, saved["prompts"], saved["heldout_prompts"], saved["max_tokens"])
    counts = generated_counts(traffic["train"], LlamaConfig.from_dir(model_dir).vocab_size)
    runs = [train_run(settings, model_dir, traffic, run["objective"], run["source"], minutes, eval_every_s,
                      vocabulary=run.get("vocabulary") or default_vocabulary(settings.draft_vocab_size),
                      counts=counts, state_dir=report_dir, earlier=run)
            for run in result["runs"]]
    machine["end"] = machine_record()
    earlier_machines = result["machine"] if isinstance(result["machine"], list) else [result["machine"]]
    earlier_commands = result["command"] if result["command"] and isinstance(result["command"][0], list) else [result["command"]]
    result.update(runs=runs, summary=summarize(runs), minutes=result["minutes"] + minutes,
                  command=earlier_commands + [sys.argv], machine=earlier_machines + [machine])
    return _write(result, report_dir)


# what a resumed run takes from the report, whatever the command line says: the traffic's and the trainer's settings
RESUMED_SETTINGS = ("model", "dtype", "seed", "draft_vocab_size", "train_records", "train_positions", "lr",
                    "unroll_steps", "record_features_max_bytes")
MEASUREMENT = {"cpu_seconds": "time.process_time() of this process (all threads), evaluation excluded",
               "acceptance_length": "mean tokens per verify step of exact greedy decoding, k = 4, over "
                                    "the held-out requests (specrl.speculation.simulate.simulate_greedy)",
               "per_position_acceptance_rate": "a k = 4 draft at every held-out position whose 4 next tokens are "
                                               "known: the share of them whose draft i was accepted (vLLM's "
                                               "per-position rate; position 1 is the first-token acceptance)",
               "trained_tokens": "drafter positions in the loss (the trainer's use=trained)"}


def _write(result: dict, out: Path) -> dict:
    (out / "bench-learn.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "bench-learn.png")
    print_table(result)
    print(f"report: {out / 'bench-learn.json'}\nchart:  {out / 'bench-learn.png'}")
    return result


# ---- draft vocabularies -------------------------------------------------------------------------
def default_vocabulary(draft_vocab_size: int) -> str:
    return f"first{draft_vocab_size}" if draft_vocab_size else "all"


def parse_vocabulary(name: str, vocab_size: int) -> tuple[str, int]:
    """"first8192" / "frequent8192" / "all" -> (kind, ids); a size of the whole vocabulary or more is "all"."""
    for kind in ("first", "frequent"):
        if name.startswith(kind) and name[len(kind):].isdigit() and int(name[len(kind):]) > 0:
            size = int(name[len(kind):])
            return ("all", vocab_size) if size >= vocab_size else (kind, size)
    if name == "all":
        return "all", vocab_size
    raise InvalidRequestError(f"--vocabularies: {name!r} is not firstN, frequentN (N > 0) or all")


def generated_counts(records: list, vocab_size: int) -> torch.Tensor:
    """How often the target generated each token id in the records (prompts excluded) -> [vocab_size] int64."""
    tokens = [t for r in records for t in r.tokens if 0 <= t < vocab_size]
    return torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=vocab_size)


def day0_vocabulary(name: str, counts: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """-> (draft_vocab_size setting, explicit vocabulary or None) for a day-0 drafter of that vocabulary."""
    from specrl.models.drafter import frequency_vocabulary

    kind, size = parse_vocabulary(name, len(counts))
    if kind == "frequent":
        return size, frequency_vocabulary(counts, size)
    return (0, None) if kind == "all" else (size, None)


# ---- traffic ------------------------------------------------------------------------------------
def record_traffic(settings: Settings, model_dir: Path, prompts: int, heldout: int, max_tokens: int) -> dict:
    """-> {"train": [SegmentRecord], "heldout": [SegmentRecord], "path", "recorded", "seconds", ...}:
    recorded through the native engine once per model version and these settings, then read from
    the cache."""
    from specrl.telemetry.record import SegmentRecord
    from specrl.telemetry.sink import record_tokens

    model_sha = hashlib.sha256((model_dir / "manifest.json").read_bytes()).hexdigest()[:12]
    key = hashlib.sha256(json.dumps([prompts, heldout, max_tokens, settings.seed, settings.draft_vocab_size, FIXED_K,
                                     settings.record_features_max_bytes, settings.dtype]).encode()).hexdigest()[:8]
    path = settings.home / "bench-learn" / f"{model_sha}-{key}" / "traffic.msgpack"
    recorded, seconds = False, 0.0
    if not path.is_file():
        started = time.perf_counter()
        raw = _record(settings, prompts, heldout, max_tokens)
        seconds = time.perf_counter() - started
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(msgpack.packb(raw, use_bin_type=True))
        tmp.replace(path)
        recorded = True
    raw = msgpack.unpackb(path.read_bytes(), raw=False)
    split = {name: [SegmentRecord.from_msgpack(r) for r in raw[name]] for name in ("train", "heldout")}
    tokens = sum(map(record_tokens, split["train"]))
    feature_bytes = sum(len(r.features or b"") for r in split["train"])
    return {**split, "path": str(path), "recorded": recorded, "record_seconds": round(seconds, 1),
            "model_sha256_12": model_sha, "prompts": prompts, "heldout_prompts": heldout, "max_tokens": max_tokens,
            "train_records": len(split["train"]), "train_tokens": tokens,
            "feature_bytes_per_token": feature_bytes / max(tokens, 1)}


def _record(settings: Settings, prompts: int, heldout: int, max_tokens: int) -> dict:
    import itertools

    from tqdm import tqdm

    from specrl.data import PromptMix, chat_token_ids
    from specrl.engine.engine import Engine
    from specrl.speculation.sampling import SamplingParams
    from specrl.telemetry.sink import MemorySink

    sink = MemorySink(features_max_bytes=settings.record_features_max_bytes)
    engine = Engine.from_settings(settings.replace(drafter="day0", fixed_draft_tokens=FIXED_K, prefix_cache=False,
                                                   suffix_capacity=0, max_batch=RECORD_BATCH), sink=sink, progress=True)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    out = {}
    for name, split, n in (("train", "train", prompts), ("heldout", "heldout", heldout)):
        chosen = list(itertools.islice(PromptMix(MIX, split=split, seed=settings.seed), n))
        ids = chat_token_ids(engine.tokenizer, chosen)
        sink.records.clear()
        with tqdm(total=n, desc=f"bench learn: recording {split} traffic ({max_tokens} tokens each)",
                  unit="request", file=sys.stderr, leave=False) as bar:
            for i in range(0, n, 4 * RECORD_BATCH):  # in chunks, for the progress bar
                chunk = ids[i: i + 4 * RECORD_BATCH]
                engine.generate(chunk, params)
                bar.update(len(chunk))
        out[name] = [r.to_msgpack() for r in sink.records]
    return out


# ---- training -----------------------------------------------------------------------------------
def train_run(settings: Settings, model_dir: Path, traffic: dict, objective: str, source: str, minutes: float,
              eval_every_s: float, *, vocabulary: str, counts: torch.Tensor, state_dir: Path,
              earlier: dict | None = None) -> dict:
    """One day-0 drafter of that draft vocabulary trained by `DrafterTrainer.train` on the traffic for
    `minutes` CPU-minutes (after the run `earlier`, resumed from its state in state_dir); its drafter,
    optimizer and place in the traffic are saved in state_dir for a later resume."""
    from tqdm import tqdm

    from specrl.trainer.drafter_trainer import DrafterTrainer
    from specrl.weights import WeightsStore

    name = f"{objective}/{source}/{vocabulary}"
    draft_vocab_size, ids = day0_vocabulary(vocabulary, counts)
    with tempfile.TemporaryDirectory(prefix="specrl-bench-learn-") as tmp:
        run_settings = settings.replace(objective=objective, drafter="day0", trainer_recompute=source == "recomputed",
                                        store=str(Path(tmp) / "store"), trainer_replay_records=0,
                                        draft_vocab_size=draft_vocab_size)
        trainer = DrafterTrainer(run_settings, model_dir, None, store=WeightsStore(run_settings.store_path),
                                 publisher=None, state_path=Path(tmp) / "state.pt", day0_vocabulary=ids)
        examples = _examples(traffic["train"], trainer.book.hidden_size)
        trainer.heldout = deque(_heldout(traffic["heldout"], trainer.book.hidden_size))
        _warm_up(trainer, _as_source(examples[: settings.train_records], source))
        state_path = state_file(state_dir, objective, source, vocabulary)
        if earlier is None:
            curve, cpu, wall, i, epochs = [_point(trainer, 0.0, 0.0, 0)], 0.0, 0.0, 0, 0
        else:
            curve, cpu, wall, i, epochs = _restore(trainer, state_path, earlier)
        next_eval, budget = cpu + eval_every_s, cpu + minutes * 60
        with tqdm(total=budget, initial=cpu, desc=f"bench learn: {name}", file=sys.stderr, leave=False,
                  bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} CPU-s [{elapsed}<{remaining}{postfix}]") as bar:
            bar.set_postfix(acceptance=f"{curve[-1]['acceptance_length']:.3f}")
            while cpu < budget:
                batch = _as_source(examples[i: i + settings.train_records], source)
                i += settings.train_records
                if i >= len(examples):
                    i, epochs = 0, epochs + 1
                c0, w0 = time.process_time(), time.perf_counter()
                trainer.train(batch)
                step_cpu = time.process_time() - c0
                cpu, wall = cpu + step_cpu, wall + time.perf_counter() - w0
                bar.update(min(step_cpu, budget - bar.n))
                if cpu >= next_eval or cpu >= budget:
                    curve.append(_point(trainer, cpu, wall, epochs))
                    next_eval = cpu + eval_every_s
                    bar.set_postfix(acceptance=f"{curve[-1]['acceptance_length']:.3f}",
                                    tokens=trainer.tokens["trained"])
        _save(trainer, state_path, i, epochs)
        _progress(f"{name}: {len(examples)} training examples, {len(trainer.heldout)} held out; "
                  f"acceptance length {curve[0]['acceptance_length']:.3f} -> {curve[-1]['acceptance_length']:.3f} "
                  f"after {trainer.tokens['trained']} tokens, {cpu:.0f} CPU-s")
        return {"objective": objective, "source": source, "vocabulary": vocabulary,
                "draft_vocab_size": trainer.drafter.cfg.draft_vocab_size,
                "vocabulary_share_of_generated": _share(trainer.drafter, counts),
                "curve": curve, "steps": trainer.step,
                "training_examples": len(examples), "heldout_requests": len(trainer.heldout),
                "trainer_recomputed_tokens": trainer.tokens["trainer_recomputed"],
                "full_target_loaded": bool(trainer.targets.loaded_full), "epochs": epochs}


def state_file(state_dir: Path, objective: str, source: str, vocabulary: str) -> Path:
    """Where `train_run` keeps a run's drafter, optimizer and place in the traffic."""
    return state_dir / f"state-{objective}-{source}-{vocabulary}.pt"


def _as_source(batch: list, source: str) -> list:
    """The examples as the run's trainer sees them: "recomputed" ones carry no features (copies:
    the trainer keeps what it recomputes on the example it is given)."""
    return [dataclasses.replace(e, features=None, feature_start=0) for e in batch] if source == "recomputed" else batch


def _warm_up(trainer, batch: list) -> None:
    """One untimed step, then undone: first-call costs (and loading the target to recompute with)
    are not what the runs compare."""
    from specrl.telemetry.token_use import TRAINER_USES

    saved = copy.deepcopy((trainer.drafter.state_dict(), trainer.optimizer.state_dict()))
    trainer.train(batch)
    trainer.drafter.load_state_dict(saved[0])
    trainer.optimizer.load_state_dict(saved[1])
    trainer._scaled = False  # the first timed step sets the feature scale again
    trainer.step = trainer.records = 0
    trainer.tokens = Counter({use: 0 for use in TRAINER_USES})
    trainer.features.shipped = trainer.features.recomputed = trainer.features.recomputed_tokens = 0


def _point(trainer, cpu: float, wall: float, epochs: int) -> dict:
    from specrl.speculation.simulate import heldout_acceptance

    trainer.drafter.eval()
    length, counts = heldout_acceptance(trainer.drafter, trainer.heldout, FIXED_K)
    rates = counts.per_position_acceptance_rate()
    return {"cpu_s": round(cpu, 2), "wall_s": round(wall, 2), "trained_tokens": trainer.tokens["trained"],
            "steps": trainer.step, "epochs": epochs, "acceptance_length": length,
            "first_token_acceptance": round(rates[0], 4) if rates else None,
            "per_position_acceptance_rate": [round(r, 4) for r in rates]}


def _share(drafter, counts: torch.Tensor) -> float:
    """The share of the generated tokens that the drafter's vocabulary holds."""
    ids = drafter.draft_to_target if drafter.draft_to_target is not None else torch.arange(len(counts))
    return round(float(counts[ids].sum() / counts.sum().clamp(min=1)), 4)


def _save(trainer, path: Path, position: int, epochs: int) -> None:
    """What a resumed run needs beyond its curve: the drafter, the optimizer, the counters, its place in the traffic."""
    torch.save({"drafter": trainer.drafter.state_dict(), "optimizer": trainer.optimizer.state_dict(),
                "step": trainer.step, "tokens": dict(trainer.tokens), "position": position, "epochs": epochs}, path)


def _restore(trainer, path: Path, earlier: dict) -> tuple[list, float, float, int, int]:
    """A run's saved state back into a fresh trainer -> (curve, CPU-s, wall-s, place in the traffic, epochs)."""
    try:
        state = torch.load(path, weights_only=True)
        trainer.drafter.load_state_dict(state["drafter"])
        trainer.optimizer.load_state_dict(state["optimizer"])
    except Exception as exc:  # a missing, truncated or foreign file: whatever torch.load raises for it
        raise InvalidRequestError(f"--resume: cannot restore the run from {path}: {exc}") from None
    trainer._scaled = True  # the saved drafter carries the feature scale its first step set
    trainer.step = state["step"]
    trainer.tokens = Counter(state["tokens"])
    last = earlier["curve"][-1]
    return list(earlier["curve"]), last["cpu_s"], last["wall_s"], state["position"], state["epochs"]


def _examples(records: list, hidden_size: int) -> list:
    """The records, in stream order, as training examples with complete shipped features."""
    from specrl.trainer.contexts import ContextBook

    book = ContextBook(hidden_size=hidden_size)
    examples = [e for e in map(book.add, records) if e is not None]
    missing = [e for e in examples if not e.complete]
    if missing:
        raise InvalidRequestError(f"{len(missing)} recorded examples lack features (record_features_max_bytes too "
                                  "small for these prompts?)")
    return examples


def _heldout(records: list, hidden_size: int) -> list:
    """-> (example of the whole request, features [T-1, H] float32) per held-out request (its last segment)."""
    from specrl.trainer.contexts import ContextBook

    book = ContextBook(hidden_size=hidden_size)
    last = {}
    for record in records:
        example = book.add(record)
        if example is not None and example.complete:
            last[record.request_id] = example
    out = []
    for example in last.values():
        prompt_len = len(next(r.prompt_ids for r in records if r.request_id == example.request_id and r.segment == 0))
        whole = dataclasses.replace(example, start=prompt_len)
        out.append((whole, example.features.float()))
    if not out:
        raise InvalidRequestError("no held-out request was recorded with features: raise --heldout or "
                                  "--record-features-max-bytes")
    return out


# ---- report -------------------------------------------------------------------------------------
def summarize(runs: list[dict]) -> dict:
    """Per run: acceptance length at the start and the end, tokens and CPU-seconds; per objective the
    ratio of trained tokens per CPU-second, shipped over recomputed."""
    out = {}
    for r in runs:
        first, last = r["curve"][0], r["curve"][-1]
        out[_run_name(r)] = {
            "acceptance_length": [first["acceptance_length"], last["acceptance_length"]],
            "first_token_acceptance": [first.get("first_token_acceptance"), last.get("first_token_acceptance")],
            "trained_tokens": last["trained_tokens"], "cpu_s": last["cpu_s"],
            "tokens_per_cpu_s": last["trained_tokens"] / last["cpu_s"] if last["cpu_s"] else None}
    for objective, vocabulary in {(r["objective"], r.get("vocabulary")) for r in runs}:
        shipped = out.get(_run_name({"objective": objective, "source": "shipped", "vocabulary": vocabulary}))
        recomputed = out.get(_run_name({"objective": objective, "source": "recomputed", "vocabulary": vocabulary}))
        if shipped and recomputed and shipped["tokens_per_cpu_s"] and recomputed["tokens_per_cpu_s"]:
            key = "/".join(x for x in (objective, vocabulary, "shipped_over_recomputed_tokens_per_cpu_s") if x)
            out[key] = shipped["tokens_per_cpu_s"] / recomputed["tokens_per_cpu_s"]
    return out


def _run_name(run: dict) -> str:
    """objective/source, and /vocabulary where the run names one (reports before vocabularies have none)."""
    return "/".join(x for x in (run["objective"], run["source"], run.get("vocabulary")) if x)


def print_table(result: dict) -> None:
    machines = result["machine"] if isinstance(result["machine"], list) else [result["machine"]]
    for piece, machine in enumerate(machines):
        for when, reading in machine.items():
            print(f"machine (piece {piece + 1}, {when}): {machine_line(reading)}")
    print(f"{'run':<30} {'acc.k4 start':>12} {'end':>6} {'first tok':>9} {'tokens':>8} {'CPU s':>7} {'tok/CPU s':>9}")
    for name, s in result["summary"].items():
        if isinstance(s, dict):
            first = (s.get("first_token_acceptance") or [None, None])[1]
            print(f"{name:<30} {s['acceptance_length'][0]:>12.3f} {s['acceptance_length'][1]:>6.3f} "
                  f"{'-' if first is None else f'{first:.3f}':>9} "
                  f"{s['trained_tokens']:>8} {s['cpu_s']:>7.1f} {s['tokens_per_cpu_s'] or 0:>9.1f}")
    for name, ratio in result["summary"].items():
        if not isinstance(ratio, dict):
            print(f"{name}: {ratio:.2f}x")


def plot(result: dict, path: Path) -> None:
    """Held-out acceptance length against trained tokens and against CPU-seconds, and the first-token
    acceptance against trained tokens (where the report has it), one line per run."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.8))
    by_tokens, by_cpu, first = fig.subplots(1, 3)
    by_cpu.sharey(by_tokens)
    for i, r in enumerate(result["runs"]):
        style = dict(color=f"C{i % 10}", linestyle="-" if r["source"] == "shipped" else "--", marker="o", markersize=3,
                     label=_run_name(r).replace("/", " "))
        curve = r["curve"]
        tokens = [p["trained_tokens"] for p in curve]
        by_tokens.plot(tokens, [p["acceptance_length"] for p in curve], **style)
        by_cpu.plot([p["cpu_s"] for p in curve], [p["acceptance_length"] for p in curve], **style)
        if all(p.get("first_token_acceptance") is not None for p in curve):
            first.plot(tokens, [p["first_token_acceptance"] for p in curve], **style)
    by_tokens.set(xlabel="trained tokens", ylabel=f"held-out acceptance length (k={result['eval_k']})")
    by_cpu.set(xlabel="training CPU-seconds")
    first.set(xlabel="trained tokens", ylabel="held-out first-token acceptance")
    by_cpu.legend(fontsize="small")
    fig.suptitle(f"bench learn: {result['model']}, {result['traffic']['train_records']} records "
                 f"({result['traffic']['train_tokens']} tokens), {result['minutes']:g} CPU-min per run")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _progress(message: str) -> None:
    print(f"bench learn: {message}", file=sys.stderr, flush=True)
