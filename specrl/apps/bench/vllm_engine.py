"""The vLLM rows of `specrl bench engine`: vLLM's engine on the native rows' workload, in a child process.

Why a child process: importing vLLM changes torch's threading for the whole process, so the
native rows would no longer measure what they measure alone.

Why vLLM's engine and not `specrl serve --backend vllm` over HTTP: the native rows time
`Engine.step` in process, without HTTP, and the API cannot ask for exactly `new_tokens`
tokens (no `ignore_eos`). The child builds the very engine `specrl serve --backend vllm`
serves (`build_vllm_loop`: AsyncLLM, eager float32, the worker extension that runs specrl's
drafter exactly, telemetry off) and drives it through the serving loop's own `submit` /
`outputs`, streaming deltas: so TTFT is the first delta's arrival, as it would reach the API.
vLLM runs as it always does, its engine core in a process of its own beside the front-end
process; its model worker gets the bench's thread count, unpinned (`backends.vllm_env`).

One child per configuration: vLLM plain (`drafter none`) and vLLM with the drafter (the
configured one, else the day-0 head with the native rows' seed: the same weights), each
warmed up and timed once per batch size like the native rows. The child's weights store is
an empty temporary directory, so the base model serves in both.

    python -m specrl.apps.bench.vllm_engine JOB.json ROWS.json   (JOB: written by `vllm_rows`)
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specrl.config import Settings
from specrl.errors import SpecrlError
from specrl.spec.sampling import SamplingParams

DTYPE_SUFFIX = {"float32": "", "float16": "_fp16", "bfloat16": "_bf16"}  # bench rows' names by dtype

VLLM_PLAIN, VLLM_SPEC = "vllm_plain", "vllm_spec"


# ---- the bench process ---------------------------------------------------------------------
def vllm_rows(settings: Settings, drafter: str, prompts: list[list[int]], batch_sizes: list[int], new_tokens: int,
              threads: int, log_dir: Path, dtypes: tuple[str, ...] = ("float32",)) -> list[dict]:
    """Run vLLM plain, then vLLM with `drafter`, each in a child process, in each of `dtypes`
    (rows of another dtype than float32 are named with its suffix, DTYPE_SUFFIX). -> their rows
    (`engine.timed_row` rows plus `startup_s` and `dtype`); the children's logs go to `log_dir`."""
    from specrl.apps.bench.backends import settings_record, vllm_env

    rows = []
    log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specrl-bench-vllm-") as tmp:
        env = {**os.environ, **vllm_env(threads), "TMPDIR": tmp}  # its exported drafters are removed with tmp
        for dtype, (name, drafter_setting) in ((d, e) for d in dtypes for e in ((VLLM_PLAIN, "none"), (VLLM_SPEC, drafter))):
            name += DTYPE_SUFFIX[dtype]
            child = settings.replace(drafter=drafter_setting, store=str(Path(tmp) / "store"), redis_url="",
                                     threads=threads, dtype=dtype)
            job, out = Path(tmp) / f"{name}.json", Path(tmp) / f"{name}-rows.json"
            job.write_text(json.dumps({"engine": name, "settings": settings_record(child), "prompts": prompts,
                                       "batch_sizes": batch_sizes, "new_tokens": new_tokens}))
            _run_child([sys.executable, "-m", "specrl.apps.bench.vllm_engine", str(job), str(out)], env,
                       log_dir / f"{name}.log")
            rows += [{**row, "dtype": dtype} for row in json.loads(out.read_text())]
    return rows


def _run_child(cmd: list[str], env: dict, log: Path) -> None:
    """Run `cmd`, its output into `log`; pass its progress lines (`bench ...`) on to stderr."""
    print(f"bench engine: starting vLLM in a child process, log={log}", file=sys.stderr, flush=True)
    with open(log, "w") as fh, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                text=True, bufsize=1) as proc:
        for line in proc.stdout:
            fh.write(line)
            if line.startswith("bench "):
                print(line, end="", file=sys.stderr, flush=True)
    if proc.returncode != 0:
        raise SpecrlError(f"the vLLM bench process exited with {proc.returncode}; see {log}")


# ---- the child process ---------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    job_path, out_path = argv if argv is not None else sys.argv[1:]
    job = json.loads(Path(job_path).read_text())
    settings = Settings.load(env={}, **job["settings"])
    rows = asyncio.run(_measure(job["engine"], settings, job["prompts"], job["batch_sizes"], job["new_tokens"]))
    Path(out_path).write_text(json.dumps(rows))
    return 0


async def _measure(name: str, settings: Settings, prompts: list[list[int]], batch_sizes: list[int],
                   new_tokens: int) -> list[dict]:
    """Start the engine; per batch size one warm-up run and one timed run -> rows."""
    from specrl.apps.bench.engine import timed_row
    from specrl.serving.vllm.build import build_vllm_loop
    from specrl.weights import WeightsStore

    started = time.perf_counter()
    loop = build_vllm_loop(settings, WeightsStore(settings.store_path))
    await loop.ready()
    startup_s = time.perf_counter() - started
    print(f"bench engine={name} vllm_ready seconds={startup_s:.1f}", file=sys.stderr, flush=True)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    try:
        for b in batch_sizes:
            await _batch(loop, prompts[:b], params)
            begun = time.perf_counter()
            stats = await _batch(loop, prompts[:b], params)
            rows.append({**timed_row(name, b, time.perf_counter() - begun, stats), "startup_s": startup_s})
    finally:
        loop.stop(timeout=10)
    return rows


async def _batch(loop, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Submit every prompt at once, stream every output -> `engine.batch_stats`."""
    from specrl.apps.bench.engine import batch_stats

    started = time.perf_counter()
    requests = [loop.submit(p, params, f"bench-{time.monotonic_ns()}-{i}") for i, p in enumerate(prompts)]

    async def consume(request_id: str) -> tuple[int, float]:
        tokens, first = 0, None
        async for out in loop.outputs(request_id):
            if out.new_token_ids and first is None:
                first = time.perf_counter() - started
            tokens += len(out.new_token_ids)
        return tokens, first

    done = await asyncio.gather(*(consume(r.request_id) for r in requests))
    tokens = [t for t, _ in done]
    if not loop.has_drafter:  # without speculation vLLM reports no per-request steps: one per token
        for request, count in zip(requests, tokens):
            request.spec.num_steps = count
    return batch_stats(tokens, [f for _, f in done], [r.spec for r in requests], speculative=loop.has_drafter)


if __name__ == "__main__":
    sys.exit(main())
