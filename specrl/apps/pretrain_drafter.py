"""`specrl pretrain-drafter`: a trained day-0 head for a model, distilled offline from the target's own outputs.

One run of what `specrl bench learn` measures (issue 57, step 1: the kl objective on the records' shipped
features over the first 8192 ids went 1.04 -> 1.52 tokens a k = 4 step on held-out prompts in 30 CPU-minutes,
where an untrained head starts every deployment), written as a drafter directory that `--drafter pretrained`
serves:
1. the traffic: `--prompts` prompts of the bundled train mix and `--heldout` of the held-out split, greedy
   through the native engine, recorded once and cached (`bench learn`'s `record_traffic`);
2. one day-0 drafter (`--seed`) trained by the drafter trainer on those records, epoch after epoch, for
   `--minutes` CPU-minutes (`bench learn`'s `train_run`: the same loss, optimizer and held-out curve);
3. the drafter saved compact (int8 rows, `drafter.INT8_ROWS`) in `--out`, beside PRETRAINED_MANIFEST: the
   command, the settings, the minutes, the held-out curve, the machine, and the weights file's sha256, which
   `--drafter pretrained` checks before it loads the head; the curve drawn under <home>/reports/.
Reproducible up to the machine: the same seed, prompts and minutes give the same traffic and the same order of
training; the CPU-minute budget ends the run at a step count that depends on the CPU's speed (the manifest
says how many steps ran).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from specrl.apps.bench.backends import machine_record, settings_record
from specrl.apps.bench.learn import FIXED_K, default_vocabulary, generated_counts, plot, record_traffic, state_file, train_run
from specrl.apps.flags import COMMON, add_settings, settings_from
from specrl.assets import resolve_model
from specrl.config import Settings
from specrl.engine.start import PRETRAINED_MANIFEST, SHIPPED_DRAFTERS
from specrl.errors import InvalidRequestError
from specrl.models.drafter import WEIGHTS_FILE, DrafterConfig, EagleDrafter
from specrl.models.llama import LlamaConfig, load_llama_head

OBJECTIVE, SOURCE = "kl", "shipped"  # the best of issue 57 step 1's runs per CPU-second


def register(sub) -> None:
    p = sub.add_parser("pretrain-drafter", help="train a day-0 head offline on the target's own outputs (what "
                                                "--drafter pretrained serves)")
    p.add_argument("--minutes", type=float, default=30.0, help="training CPU-minutes")
    p.add_argument("--prompts", type=int, default=1024, help="training prompts recorded (bundled train mix)")
    p.add_argument("--heldout", type=int, default=64, help="held-out prompts recorded (the curve's)")
    p.add_argument("--max-tokens", type=int, default=128, help="greedy tokens per recorded prompt")
    p.add_argument("--eval-every", type=float, default=120.0, help="CPU-seconds of training between evaluations")
    p.add_argument("--out", default=None,
                   help=f"drafter directory to write (default: {SHIPPED_DRAFTERS}/<model>, what ships)")
    add_settings(p, *COMMON, "model", "dtype", "draft_vocab_size", "train_records", "train_positions", "lr",
                 "seed", "record_features_max_bytes")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    out = Path(args.out) if args.out else SHIPPED_DRAFTERS / settings.model
    manifest = pretrain_drafter(settings, out, minutes=args.minutes, prompts=args.prompts, heldout=args.heldout,
                                max_tokens=args.max_tokens, eval_every_s=args.eval_every)
    curve = manifest["curve"]
    print(f"pretrained drafter: {out} ({manifest['weights_bytes'] / 1e6:.1f} MB, sha256 {manifest['sha256'][:12]}): "
          f"held-out tokens a k=4 step {curve[0]['acceptance_length']:.3f} -> {curve[-1]['acceptance_length']:.3f}, "
          f"first-token acceptance {curve[-1]['first_token_acceptance']}, after {curve[-1]['cpu_s'] / 60:.1f} CPU-min")
    return 0


def pretrain_drafter(settings: Settings, out: Path, *, minutes: float, prompts: int, heldout: int, max_tokens: int,
                     eval_every_s: float) -> dict:
    """Record (or load) the traffic, train one head, write it compact with its manifest into `out` -> the manifest."""
    if minutes <= 0 or prompts < 1 or heldout < 1 or max_tokens < 1 or eval_every_s <= 0:
        raise InvalidRequestError("--minutes, --prompts, --heldout, --max-tokens and --eval-every must be > 0")
    model_dir = resolve_model(settings.model, settings.home)
    started, machine = time.perf_counter(), machine_record()
    traffic = record_traffic(settings, model_dir, prompts, heldout, max_tokens)
    vocabulary = default_vocabulary(settings.draft_vocab_size)
    counts = generated_counts(traffic["train"], LlamaConfig.from_dir(model_dir).vocab_size)
    with tempfile.TemporaryDirectory(prefix="specrl-pretrain-") as tmp:
        trained = train_run(settings, model_dir, traffic, OBJECTIVE, SOURCE, minutes, eval_every_s,
                            vocabulary=vocabulary, counts=counts, state_dir=Path(tmp))
        state = torch.load(state_file(Path(tmp), OBJECTIVE, SOURCE, vocabulary), weights_only=True)
    target = load_llama_head(model_dir)
    drafter = EagleDrafter(DrafterConfig.for_target(target.cfg, trained["draft_vocab_size"]), target)
    drafter.load_state_dict(state["drafter"])
    out.mkdir(parents=True, exist_ok=True)
    drafter.save(out, int8_rows=True)
    weights = (out / WEIGHTS_FILE).read_bytes()
    manifest = {"command": ["specrl", *sys.argv[1:]], "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "model": settings.model, "settings": settings_record(settings), "objective": OBJECTIVE,
                "feature_source": SOURCE, "vocabulary": vocabulary, "minutes": minutes,
                "wall_minutes": round((time.perf_counter() - started) / 60, 1),
                "traffic": {k: v for k, v in traffic.items() if k not in ("train", "heldout", "path")},
                "steps": trained["steps"], "epochs": trained["epochs"], "curve": trained["curve"],
                "machine": machine, "torch": torch.__version__, "weights_file": WEIGHTS_FILE,
                "weights_bytes": len(weights), "sha256": hashlib.sha256(weights).hexdigest()}
    (out / PRETRAINED_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    chart = settings.home / "reports" / f"pretrain-drafter-{time.strftime('%Y%m%d-%H%M%S')}.png"
    plot_curve(manifest, chart)
    print(f"chart: {chart}")
    return manifest


def plot_curve(manifest: dict, path: Path) -> Path:
    """A pretrained head's held-out curve (its manifest's) as `bench learn` draws one run -> a PNG at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    run = {"objective": manifest["objective"], "source": manifest["feature_source"],
           "vocabulary": manifest["vocabulary"], "curve": manifest["curve"]}
    plot({"runs": [run], "eval_k": FIXED_K, "model": manifest["model"], "traffic": manifest["traffic"],
          "minutes": manifest["minutes"]}, path)
    return path
