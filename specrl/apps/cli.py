"""`specrl ...`: the one command-line entry point. Errors print one line and exit non-zero.

Each command is a `register(subparsers)` beside the function it runs; the flags that set a
`Settings` field come from the field itself (`specrl.apps.flags`). `specrl --help` lists the
commands under the headings of `COMMAND_GROUPS`, one line each: the `help=` they registered with.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from specrl.apps.flags import COMMON, ENGINE, add_settings, settings_from
from specrl.errors import SpecrlError

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."
DESCRIPTION = "Serve with speculative decoding, learn the drafter online, hot-swap weights."
# `specrl --help`'s headings, in this order, and the commands under each (as vLLM's and uv's CLIs group
# theirs). Every registered command belongs in exactly one group: tests/cli/test_help.py fails otherwise,
# and `command_listing` shows a command missing here under "Other" rather than hiding it.
COMMAND_GROUPS = (
    ("Serve", ("serve", "generate")),
    ("Run the whole loop", ("up",)),
    ("Train", ("train-drafter", "pretrain-drafter")),
    ("RL", ("rl",)),
    ("Evaluate", ("eval-policy",)),
    ("Benchmark", ("bench",)),
    ("Admin", ("admin",)),
    ("Models", ("fetch-model", "export-drafter")),
)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return args.run(args) or 0
    except SpecrlError as exc:
        print(f"specrl: error: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("specrl: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    from specrl.apps import admin, bench, eval_policy, pretrain_drafter, rl, up

    parser = argparse.ArgumentParser(prog="specrl", formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Run `specrl <command> --help` for a command's flags.")
    # argparse's own list of the commands is suppressed: the description lists them, grouped.
    sub = parser.add_subparsers(metavar="<command>", help=argparse.SUPPRESS)
    for register in (register_fetch_model, register_generate, up.register, rl.register, eval_policy.register,
                     register_serve, register_export_drafter, register_train_drafter, pretrain_drafter.register,
                     bench.register,
                     admin.register):
        register(sub)
    # Set after add_subparsers: the commands' own usage lines ("usage: specrl serve ...") derive from it.
    parser.usage = "%(prog)s [-h] <command> ..."
    parser.description = f"{DESCRIPTION}\n\n{command_listing(commands_of(parser))}"
    return parser


def commands_of(parser: argparse.ArgumentParser) -> dict[str, str]:
    """The commands registered on `parser` -> the `help=` each was registered with, in that order.
    argparse keeps a command's help only on its entry in the subparsers action."""
    [sub] = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    return {entry.dest: entry.help for entry in sub._choices_actions}


def command_listing(commands: dict[str, str], groups=COMMAND_GROUPS) -> str:
    """The commands under the headings of `groups`, in its order, one line each ("  name  help");
    commands no group names come last, under "Other"."""
    grouped = {name for _, names in groups for name in names}
    sections = [(heading, [n for n in names if n in commands]) for heading, names in groups]
    sections.append(("Other", [name for name in commands if name not in grouped]))
    width = max(map(len, commands), default=0)
    return "\n\n".join(f"{heading}:\n" + "\n".join(f"  {name:<{width}}  {commands[name]}" for name in names)
                       for heading, names in sections if names)


# ---- fetch-model ------------------------------------------------------------------------------
def register_fetch_model(sub) -> None:
    p = sub.add_parser("fetch-model", help="fetch and convert a model into the cache home")
    p.add_argument("alias", nargs="?", default="smollm2-135m", help="smollm2-135m (default) or tiny-random")
    p.add_argument("--force", action="store_true", help="rebuild even if present")
    p.add_argument("--verify", action="store_true", help="re-hash the files against the manifest")
    add_settings(p, *COMMON)
    p.set_defaults(run=fetch_model)


def fetch_model(args: argparse.Namespace) -> int:
    from specrl.assets import fetch_model as fetch, verify_manifest

    settings = settings_from(args)
    started = time.perf_counter()
    path = fetch(args.alias, settings.home, force=args.force)
    if args.verify:
        problems = verify_manifest(path)
        if problems:
            print(f"specrl: error: {path} is damaged: {'; '.join(problems)} (run with --force)", file=sys.stderr)
            return 1
    print(f"{args.alias}: {path} ({time.perf_counter() - started:.1f} s)")
    return 0


# ---- generate ---------------------------------------------------------------------------------
def register_generate(sub) -> None:
    p = sub.add_parser("generate", help="one generation with speculative decoding: text and stats")
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed of this request")
    p.add_argument("--no-chat", action="store_true", help="use the prompt as raw text, no chat template")
    add_settings(p, *COMMON, *ENGINE)
    p.set_defaults(run=generate)


def generate(args: argparse.Namespace) -> int:
    from specrl.engine.engine import Engine
    from specrl.speculation.sampling import SamplingParams

    engine = Engine.from_settings(settings_from(args))
    if args.no_chat:
        prompt_ids = engine.tokenizer.encode(args.prompt)
    else:
        prompt_ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                          add_generation_prompt=True, tokenize=True, return_dict=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    started = time.perf_counter()
    [done] = engine.generate([list(prompt_ids)], params)
    seconds = time.perf_counter() - started
    print(done.text)
    print(json.dumps({"tokens": len(done.output_ids), "seconds": round(seconds, 2),
                      "tokens_per_s": round(len(done.output_ids) / seconds, 1),
                      "tokens_per_step": round(done.spec.tokens_per_step or 1.0, 2),
                      "finish_reason": done.finish_reason, "target_version": done.target_version,
                      "drafter_version": done.drafter_version}), file=sys.stderr)
    return 0


# ---- serve ------------------------------------------------------------------------------------
def register_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API with speculative decoding")
    add_settings(p, *COMMON, *ENGINE, "backend", "host", "port", "redis_url", "store", "durable_store", "deployment",
                 "replica",
                 "telemetry_content", "api_key", "prefix_cache", "record_features", "record_features_max_bytes",
                 "fixed_draft_tokens", "follow_current", "follow_interval_s")
    p.set_defaults(run=serve)


def serve(args: argparse.Namespace) -> int:
    from specrl.serving.server import serve as run_server

    return run_server(settings_from(args))


# ---- export-drafter ---------------------------------------------------------------------------
def register_export_drafter(sub) -> None:
    p = sub.add_parser("export-drafter", help="write a drafter in another serving format (vLLM's EAGLE head)")
    p.add_argument("directory", help="a specrl drafter directory (drafter.json + drafter.safetensors)")
    p.add_argument("--format", required=True, choices=["vllm"])
    p.add_argument("--out", required=True, help="output directory (vLLM: speculative_config model=OUT)")
    add_settings(p, *COMMON, "model")
    p.set_defaults(run=export_drafter)


def export_drafter(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specrl.assets import resolve_model
    from specrl.export import export_vllm

    settings = settings_from(args)
    out = export_vllm(Path(args.directory), resolve_model(settings.model, settings.home), Path(args.out))
    print(f"vLLM EAGLE head: {out} (speculative_config={{\"method\": \"eagle\", \"model\": \"{out}\"}})")
    return 0


# ---- train-drafter ----------------------------------------------------------------------------
def register_train_drafter(sub) -> None:
    p = sub.add_parser("train-drafter", help="learn the drafter from the reward stream; publish and swap")
    p.add_argument("--server", action="append", default=None, help="replica URL to swap (repeatable)")
    add_settings(p, *COMMON, "model", "draft_vocab_size", "redis_url", "store", "durable_store", "deployment",
                 "objective", "lr", "train_records", "unroll_steps", "publish_every_s", "publish_every_steps",
                 "publish_margin",
                 "canary_tokens", "canary_margin", "consumer",
                 "trainer_metrics_port", "trainer_events", "trainer_recompute", "trainer_max_age_s",
                 "trainer_replay_records", "record_features_max_bytes", aliases={"trainer_metrics_port": ["--metrics-port"]})
    p.set_defaults(run=train_drafter)


def train_drafter(args: argparse.Namespace) -> int:
    from specrl.trainer.main import train_drafter as run_trainer

    return run_trainer(settings_from(args, servers=",".join(args.server) if args.server else None))


if __name__ == "__main__":
    sys.exit(main())
