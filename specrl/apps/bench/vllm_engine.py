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

One child per dtype, holding both engines: vLLM plain (`drafter none`) and vLLM with the
drafter (the configured one, the shipped head by default, else the day-0 head with the native rows' seed: the same weights),
each its own AsyncLLM with its own engine core process, started one after the other. Per batch
size both are warmed up, then timed in alternating rounds like the native rows
(`engine.measure_alternately`): measured one child after the other, vLLM speculative over plain
read 0.80x in one run and 1.03x in the next on the same machine. The child's weights store is
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
from specrl.speculation.sampling import SamplingParams

# bench rows' names by dtype
DTYPE_SUFFIX = {"float32": "", "float16": "_fp16", "bfloat16": "_bf16", "int8": "_int8", "q4": "_q4"}

VLLM_PLAIN, VLLM_SPEC = "vllm_plain", "vllm_spec"
# vLLM's worker busy-polls its message queue for 1 s after its last read (shm_broadcast's
# busy_loop_s): an engine timed right after the other shared the cores with that spin. Measured on
# an AVX2 EPYC without the pause: two identical plain vLLM engines read 1.20x apart at B=1.
SETTLE_S = 1.5


# ---- the bench process ---------------------------------------------------------------------
def vllm_rows(settings: Settings, drafter: str, prompts: list[list[int]], batch_sizes: list[int], new_tokens: int,
              threads: int, log_dir: Path, dtypes: tuple[str, ...] = ("float32",)) -> list[dict]:
    """Run vLLM plain beside vLLM with `drafter`, one child process per dtype of `dtypes` (rows of
    another dtype than float32 are named with its suffix, DTYPE_SUFFIX). -> their rows
    (`engine.timed_row` rows plus `startup_s` and `dtype`); the children's logs go to `log_dir`."""
    from specrl.apps.bench.backends import settings_record, vllm_env

    rows = []
    log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specrl-bench-vllm-") as tmp:
        env = {**os.environ, **vllm_env(threads), "TMPDIR": tmp}  # its exported drafters are removed with tmp
        for dtype in dtypes:
            engines = {name + DTYPE_SUFFIX[dtype]: settings_record(settings.replace(
                drafter=drafter_setting, store=str(Path(tmp) / "store"), redis_url="", threads=threads, dtype=dtype))
                for name, drafter_setting in ((VLLM_PLAIN, "none"), (VLLM_SPEC, drafter))}
            job, out = Path(tmp) / f"vllm-{dtype}.json", Path(tmp) / f"vllm-{dtype}-rows.json"
            job.write_text(json.dumps({"engines": engines, "prompts": prompts, "batch_sizes": batch_sizes,
                                       "new_tokens": new_tokens}))
            _run_child([sys.executable, "-m", "specrl.apps.bench.vllm_engine", str(job), str(out)], env,
                       log_dir / f"vllm-{dtype}.log")
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
    engines = {name: Settings.load(env={}, **record) for name, record in job["engines"].items()}
    rows = _measure(engines, job["prompts"], job["batch_sizes"], job["new_tokens"])
    Path(out_path).write_text(json.dumps(rows))
    return 0


def _measure(engines: dict[str, Settings], prompts: list[list[int]], batch_sizes: list[int],
             new_tokens: int) -> list[dict]:
    """Start every engine (one event loop serves them all; it runs only while a batch is timed),
    then per batch size measure them alternately -> rows."""
    from specrl.apps.bench.engine import measure_alternately
    from specrl.serving.vllm.build import build_vllm_loop
    from specrl.weights import WeightsStore

    events = asyncio.new_event_loop()
    loops, startup_s = {}, {}
    try:
        for name, settings in engines.items():
            started = time.perf_counter()
            loops[name] = build_vllm_loop(settings, WeightsStore(settings.store_path))
            events.run_until_complete(loops[name].ready())
            startup_s[name] = time.perf_counter() - started
            print(f"bench engine={name} vllm_ready seconds={startup_s[name]:.1f}", file=sys.stderr, flush=True)
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        rows = []
        for b in batch_sizes:
            runs = {name: (lambda loop=loop: events.run_until_complete(_batch(loop, prompts[:b], params)))
                    for name, loop in loops.items()}
            rows += [{**row, "startup_s": startup_s[row["engine"]]} for row in measure_alternately(runs, b, SETTLE_S)]
        return rows
    finally:
        for loop in loops.values():
            loop.stop(timeout=10)
        events.close()


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
