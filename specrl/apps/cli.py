"""`specrl ...`: the one command-line entry point. Errors print one line and exit non-zero."""

from __future__ import annotations

import argparse
import json
import sys
import time

from specrl.config import Settings
from specrl.errors import InvalidRequestError, SpecrlError

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specrl", description=__doc__)
    sub = parser.add_subparsers(title="commands")

    fetch = sub.add_parser("fetch-model", help="fetch and convert a model into the cache home")
    fetch.add_argument("alias", nargs="?", default="smollm2-135m", help="smollm2-135m (default) or tiny-random")
    fetch.add_argument("--force", action="store_true", help="rebuild even if present")
    fetch.add_argument("--verify", action="store_true", help="re-hash the files against the manifest")
    _common(fetch)
    fetch.set_defaults(run=_fetch_model)

    gen = sub.add_parser("generate", help="generate with speculative decoding and print the text and stats")
    gen.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--no-chat", action="store_true", help="use the prompt as raw text, no chat template")
    _common(gen)
    _engine_flags(gen)
    gen.set_defaults(run=_generate)

    up = sub.add_parser("up", help="the whole loop: Redis, server, drafter trainer, demo traffic, live view, report")
    up.add_argument("--demo", action="store_true", help="replay the bundled prompt mix through the API")
    up.add_argument("--duration", type=float, default=0, help="seconds to run (0: until Ctrl-C)")
    up.add_argument("--users", type=int, default=4, help="concurrent demo clients")
    up.add_argument("--redis-url", default=None, help="default: $REDIS_URL, else an embedded Valkey server")
    up.add_argument("--port", type=int, default=None)
    up.add_argument("--model", default=None)
    up.add_argument("--deployment", default=None)
    _common(up)
    up.set_defaults(run=_up)

    rl = sub.add_parser("rl", help="the policy RL loop: server + rollouts + GRPO + drafter trainer; writes a report")
    rl.add_argument("--env", required=True, choices=["arithmetic", "code", "format"])
    rl.add_argument("--minutes", type=float, default=30.0)
    rl.add_argument("--group-size", type=int, default=4, help="samples per task (GRPO group)")
    rl.add_argument("--tasks-per-step", type=int, default=4)
    rl.add_argument("--publish-every", type=int, default=2, help="GRPO steps per published policy")
    rl.add_argument("--eval-every", type=int, default=4)
    rl.add_argument("--eval-tasks", type=int, default=24)
    rl.add_argument("--max-tokens", type=int, default=64)
    rl.add_argument("--policy-lr", type=float, default=2e-6)
    rl.add_argument("--max-lag", type=int, default=1, help="staleness bound in policy versions")
    rl.add_argument("--redis-url", default=None)
    rl.add_argument("--port", type=int, default=None)
    rl.add_argument("--model", default=None)
    rl.add_argument("--deployment", default=None)
    rl.add_argument("--out", default=None)
    _common(rl)
    rl.set_defaults(run=_rl)

    ev = sub.add_parser("eval-policy", help="held-out reward of policy versions side by side, paired CI")
    ev.add_argument("--env", required=True, choices=["arithmetic", "code", "format"])
    ev.add_argument("--versions", required=True, help="comma-separated policy versions of the store; base = the model")
    ev.add_argument("--tasks", type=int, default=128, help="held-out tasks (the same for every version)")
    ev.add_argument("--max-tokens", type=int, default=64)
    ev.add_argument("--store", default=None, help="weights store root (default: the store of `specrl rl --deployment`)")
    ev.add_argument("--deployment", default=None)
    ev.add_argument("--model", default=None)
    ev.add_argument("--out", default=None, help="JSON report path")
    _common(ev)
    ev.set_defaults(run=_eval_policy)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API with speculative decoding")
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--redis-url", default=None, help="reward events go to this Redis (env SPECRL_REDIS_URL)")
    serve.add_argument("--store", default=None, help="weights store root (default <home>/weights)")
    serve.add_argument("--deployment", default=None)
    serve.add_argument("--replica", default=None)
    serve.add_argument("--backend", default=None, choices=["native", "vllm"],
                       help="native (default) or vllm (needs the [vllm] extra; env SPECRL_BACKEND)")
    serve.add_argument("--no-telemetry-content", dest="telemetry_content", action="store_const", const=False,
                       default=None, help="record counters only, no token ids")
    _common(serve)
    _engine_flags(serve)
    serve.set_defaults(run=_serve)

    export = sub.add_parser("export-drafter", help="write a drafter in another serving format (vLLM's EAGLE head)")
    export.add_argument("drafter", help="a specrl drafter directory (drafter.json + drafter.safetensors)")
    export.add_argument("--format", required=True, choices=["vllm"])
    export.add_argument("--out", required=True, help="output directory (vLLM: speculative_config model=OUT)")
    export.add_argument("--model", default=None, help="the target it drafts for (alias or HF directory)")
    _common(export)
    export.set_defaults(run=_export_drafter)

    train = sub.add_parser("train-drafter", help="learn the drafter from the reward stream; publish and swap")
    train.add_argument("--redis-url", default=None)
    train.add_argument("--server", action="append", default=None, help="replica URL to swap (repeatable)")
    train.add_argument("--store", default=None)
    train.add_argument("--deployment", default=None)
    train.add_argument("--objective", default=None, choices=["kl", "kl_neg", "pg"])
    train.add_argument("--lr", type=float, default=None)
    train.add_argument("--train-records", type=int, default=None, help="records per optimizer step")
    train.add_argument("--unroll-steps", type=int, default=None,
                       help="extra passes on the drafter's own predicted features (training-time test); 0 = off")
    train.add_argument("--publish-every-s", type=float, default=None)
    train.add_argument("--publish-every-steps", type=int, default=None)
    train.add_argument("--consumer", default=None, help="stable consumer name in the group")
    train.add_argument("--metrics-port", dest="trainer_metrics_port", type=int, default=None,
                       help="serve Prometheus metrics (consumer lag, steps) on this port")
    train.add_argument("--model", default=None)
    _draft_vocab_flag(train)
    _common(train)
    train.set_defaults(run=_train_drafter)

    bench = sub.add_parser("bench", help="benchmarks (print a table, write JSON and PNG)")
    bench_sub = bench.add_subparsers(title="benchmarks")
    engine = bench_sub.add_parser("engine", help="native plain vs native speculative vs HF generate, and vLLM plain "
                                                 "vs vLLM speculative: tokens/s, TTFT, ratios")
    engine.add_argument("--batch-sizes", default="1,8")
    engine.add_argument("--new-tokens", type=int, default=64)
    _bench_backend_flag(engine)
    engine.add_argument("--out", default=None, help="report directory (default <home>/reports/bench-engine-<time>)")
    _common(engine)
    _engine_flags(engine)
    engine.set_defaults(run=_bench_engine)
    serve_bench = bench_sub.add_parser("serve", help="a live server under locust load: no swaps, drafter and policy "
                                                     "swaps, telemetry off vs on; per backend, with ratios")
    _bench_backend_flag(serve_bench)
    serve_bench.add_argument("--duration", type=float, default=30.0, help="seconds of load per scenario")
    serve_bench.add_argument("--users", type=int, default=4, help="concurrent locust users")
    serve_bench.add_argument("--redis-url", default=None, help="Redis for the telemetry-on server "
                                                               "(default redis://127.0.0.1:6379/0)")
    serve_bench.add_argument("--out", default=None, help="report directory (default <home>/reports/bench-serve-<time>)")
    _common(serve_bench)
    _engine_flags(serve_bench)
    serve_bench.set_defaults(run=_bench_serve)

    adapt = bench_sub.add_parser("adapt", help="day-0 drafter learning on live traffic: acceptance and speed "
                                               "over time, domain shift, objectives")
    adapt.add_argument("--minutes", type=float, default=10.0, help="minutes of traffic per run")
    adapt.add_argument("--objectives", default="kl", help="comma-separated: kl,kl_neg,pg (one run each)")
    adapt.add_argument("--shift", action="store_true", help="also run the domain-shift experiment")
    adapt.add_argument("--users", type=int, default=4)
    adapt.add_argument("--out", default=None, help="report directory (default <home>/reports/bench-adapt-<time>)")
    _common(adapt)
    adapt.add_argument("--model", default=None)
    _draft_vocab_flag(adapt)
    adapt.set_defaults(run=_bench_adapt)

    kernels = bench_sub.add_parser("kernels", help="Triton kernels vs their torch twins (twins only on CPU)")
    kernels.add_argument("--out", default=None, help="report directory (default <home>/reports/bench-kernels-<time>)")
    kernels.add_argument("--quick", action="store_true", help="small shapes only")
    _common(kernels)
    kernels.set_defaults(run=_bench_kernels)
    return parser


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--home", default=None, help="cache home (env SPECRL_HOME)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (env SPECRL_THREADS; 0 = torch default)")


def _bench_backend_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", dest="backends", default=None,
                   help="comma-separated backends side by side: native,vllm (default: both when vLLM is "
                        "installed); each computes with --threads threads (here 0 = vLLM's CPU default, all cores "
                        "but one)")


def _draft_vocab_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="a day-0 drafter's vocabulary: the first N token ids, 0 = all (default 8192)")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model alias or HF directory (env SPECRL_MODEL)")
    p.add_argument("--drafter", default=None, help="'day0' (untrained head), 'none', or a drafter directory")
    _draft_vocab_flag(p)
    p.add_argument("--max-draft-tokens", type=int, default=None)
    p.add_argument("--max-batch", type=int, default=None)


FLAGS = ("home", "threads", "model", "drafter", "max_draft_tokens", "max_batch", "host", "port", "redis_url", "store",
         "deployment", "replica", "telemetry_content", "objective", "lr", "train_records", "unroll_steps", "publish_every_s",
         "publish_every_steps", "consumer", "trainer_metrics_port", "backend", "draft_vocab_size")


def _settings(args: argparse.Namespace, **extra) -> Settings:
    flags = {k: getattr(args, k, None) for k in FLAGS}
    settings = Settings.load(**flags, **extra)
    if settings.threads > 0:
        import torch

        torch.set_num_threads(settings.threads)
    return settings


def _fetch_model(args: argparse.Namespace) -> int:
    from specrl.assets import fetch_model, verify_manifest

    settings = _settings(args)
    started = time.perf_counter()
    path = fetch_model(args.alias, settings.home, force=args.force)
    if args.verify:
        problems = verify_manifest(path)
        if problems:
            print(f"specrl: error: {path} is damaged: {'; '.join(problems)} (run with --force)", file=sys.stderr)
            return 1
    print(f"{args.alias}: {path} ({time.perf_counter() - started:.1f} s)")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from specrl.serving.engine import Engine
    from specrl.spec.sampling import SamplingParams

    settings = _settings(args)
    engine = Engine.from_settings(settings)
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
                      "acceptance_length": round(done.acceptance_length, 2), "finish_reason": done.finish_reason,
                      "target_version": done.target_version, "drafter_version": done.drafter_version}), file=sys.stderr)
    return 0


def _up(args: argparse.Namespace) -> int:
    import os

    from specrl.up import run_up

    args.redis_url = args.redis_url or os.environ.get("REDIS_URL") or None
    settings = _settings(args)
    run_up(settings, demo=args.demo, duration_s=args.duration, users=args.users)
    return 0


def _rl(args: argparse.Namespace) -> int:
    import os

    from specrl.trainer.grpo import GRPOConfig
    from specrl.trainer.rl import run_rl

    args.redis_url = args.redis_url or os.environ.get("REDIS_URL") or None
    run_rl(_settings(args), env_name=args.env, minutes=args.minutes, group_size=args.group_size,
           tasks_per_step=args.tasks_per_step, publish_every=args.publish_every, eval_every=args.eval_every,
           eval_tasks=args.eval_tasks, max_tokens=args.max_tokens,
           config=GRPOConfig(lr=args.policy_lr, max_lag=args.max_lag), out_dir=args.out)
    return 0


def _eval_policy(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specrl.trainer.evaluate import evaluate_policies
    from specrl.trainer.rl import with_deployment_store

    versions = [v for v in args.versions.split(",") if v]
    evaluate_policies(with_deployment_store(_settings(args)), args.env, versions, args.tasks, args.max_tokens,
                      Path(args.out) if args.out else None)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from specrl.serving.server import serve

    return serve(_settings(args))


def _export_drafter(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specrl.assets import resolve_model
    from specrl.export import export_vllm

    settings = _settings(args)
    out = export_vllm(Path(args.drafter), resolve_model(settings.model, settings.home), Path(args.out))
    print(f"vLLM EAGLE head: {out} (speculative_config={{\"method\": \"eagle\", \"model\": \"{out}\"}})")
    return 0


def _train_drafter(args: argparse.Namespace) -> int:
    from specrl.trainer.main import train_drafter

    servers = ",".join(args.server) if args.server else None
    return train_drafter(_settings(args, servers=servers))


def _bench_engine(args: argparse.Namespace) -> int:
    from specrl.bench.backends import parse_backends
    from specrl.bench.engine import run_engine_bench

    backends = parse_backends(args.backends)
    settings = _settings(args)
    try:
        sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    except ValueError:
        raise InvalidRequestError(f"--batch-sizes takes comma-separated integers, not {args.batch_sizes!r}") from None
    run_engine_bench(settings, sizes, args.new_tokens, args.out, tuple(backends))
    return 0


def _bench_adapt(args: argparse.Namespace) -> int:
    from specrl.bench.adapt import run_adapt_bench

    objectives = [o for o in args.objectives.split(",") if o]
    run_adapt_bench(_settings(args), minutes=args.minutes, objectives=objectives, shift=args.shift,
                    users=args.users, out_dir=args.out)
    return 0


def _bench_kernels(args: argparse.Namespace) -> int:
    from specrl.bench.kernels import run_kernel_bench

    run_kernel_bench(_settings(args), quick=args.quick, out_dir=args.out)
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from specrl.bench.backends import parse_backends
    from specrl.bench.serve import run_serve_bench

    backends = parse_backends(args.backends)
    run_serve_bench(_settings(args), duration_s=args.duration, users=args.users, out_dir=args.out,
                    backends=tuple(backends))
    return 0


if __name__ == "__main__":
    sys.exit(main())
