"""OpenMP worker threads: a thread that hands the model's compute to another gives its pool back.

OpenMP (libgomp, the runtime torch ships and our kernels use) keeps a pool of worker threads for
every thread that has run a parallel region: torch's ops, MKL and oneDNN, `_cpu_kernels`. While
the process holds more of those workers than the machine has cores, libgomp "throttles" every
team: between regions a worker sleeps on a futex instead of spinning, so each region pays a
wake-up (tens of microseconds; a decode step runs 60-120 regions). The server loads the model on
its main thread and decodes on the engine thread, so the main thread's idle pool throttled every
decode step: measured on a 2-core AVX-512 EPYC, SmolLM2 float16, 4 rows greedy, 107 tok/s on the
engine thread against 220 on the thread that loaded the model (`perf`: a fifth of the time in
futex wake-ups from GOMP_parallel). After `release_compute_threads()` on the loading thread the
engine thread runs at the loading thread's speed.

Who calls it: the thread that built an engine, before the engine thread starts
(`serving.engine_loop.EngineLoop.start`), and a thread that prepared swap weights, after it
(`EngineLoop.swap`). A thread that computes again later gets a new pool on its next region.
"""

from __future__ import annotations

try:
    from specrl.models import _cpu_kernels as cpu_kernels
except ImportError:  # not built: nothing of ours to release (torch's pools stay as they are)
    cpu_kernels = None


def release_compute_threads() -> bool:
    """Let the calling thread's OpenMP workers exit. -> False where that could not be done (the
    kernels are not built, or the call came from inside a parallel region)."""
    return cpu_kernels is not None and cpu_kernels.release_threads() == 0
