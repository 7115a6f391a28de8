"""Who used the CPU while a benchmark measured: named processes, the rest of the machine, the hypervisor.

A benchmark that times two engines side by side trusts that nothing else ran meanwhile. When a
measurement reads low (an AMX Xeon, 2026-12-04: plain B=1 at 44-56 tok/s in `bench adapt`'s last
checkpoints against 74-88 before), these numbers say whether it was one of the benchmark's own
processes (the server, the trainer, the meter itself), another process on the machine, or the
hypervisor giving the cores to a neighbour (steal time). Seconds of CPU over a window:
`snapshot()` before, `snapshot()` after, `use(before, after)`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class CpuSnapshot:
    """At `wall` (time.monotonic()): the machine's CPU seconds (all cores) busy and stolen, and per
    named process the CPU seconds of it and its descendants, live or ended (None: it is gone)."""

    wall: float
    busy: float
    steal: float
    processes: dict[str, float | None]


def snapshot(pids: dict[str, int]) -> CpuSnapshot:
    """pids: name -> process id (e.g. {"meter": os.getpid(), "server": ...}). A named process's
    descendants count under it, except those named themselves (the server under the meter that
    started it counts as the server)."""
    machine = psutil.cpu_times()
    steal = getattr(machine, "steal", 0.0)  # Linux only: time the host gave this VM's cores to a neighbour
    busy = machine.user + machine.system + sum(getattr(machine, f, 0.0) for f in ("nice", "irq", "softirq"))
    named = set(pids.values())
    return CpuSnapshot(time.monotonic(), busy, steal,
                       {name: _tree_seconds(pid, named - {pid}) for name, pid in pids.items()})


def _tree_seconds(pid: int, apart: set[int]) -> float | None:
    """CPU seconds of `pid` and its descendants outside the subtrees rooted at `apart` (None: `pid`
    is gone)."""
    try:
        tree = [psutil.Process(pid)]
    except psutil.Error:
        return None
    for proc in tree:  # grows as it walks: breadth first
        try:
            tree += [child for child in proc.children() if child.pid not in apart]
        except psutil.Error:  # ended while walked
            continue
    total = 0.0
    for i, proc in enumerate(tree):
        try:
            times = proc.cpu_times()
        except psutil.Error:
            if i == 0:
                return None
            continue  # a descendant that ended meanwhile
        # a descendant that ended counts in its parent's children_* once waited for, and no longer in the tree
        total += times.user + times.system + times.children_user + times.children_system
    return total


def use(before: CpuSnapshot, after: CpuSnapshot) -> dict:
    """-> {"wall_s", "cores", "busy_s", "steal_s", "<name>_s" per named process (None where it was
    gone at either end), "other_s": busy time no named process accounts for}, seconds over the
    window; busy_s + steal_s <= wall_s x cores."""
    out = {"wall_s": after.wall - before.wall, "cores": psutil.cpu_count() or 1,
           "busy_s": max(0.0, after.busy - before.busy), "steal_s": max(0.0, after.steal - before.steal)}
    named = 0.0
    for name, start in before.processes.items():
        end = after.processes.get(name)
        seconds = None if start is None or end is None else max(0.0, end - start)
        out[f"{name}_s"] = seconds
        named += seconds or 0.0
    out["other_s"] = max(0.0, out["busy_s"] - named)
    return out


def describe(cpu: dict) -> str:
    """One line: 'cpu over 64 s x 2 cores: meter 120.1 s, server 2.0 s, ..., other 0.4 s, stolen 0.0 s'."""
    names = [k for k in cpu if k.endswith("_s") and k not in ("wall_s", "busy_s", "steal_s", "other_s")]
    parts = [f"{k[:-2]} {'gone' if cpu[k] is None else format(cpu[k], '.1f') + ' s'}" for k in names]
    return (f"cpu over {cpu['wall_s']:.0f} s x {cpu['cores']} cores: " + ", ".join(parts)
            + f", other {cpu['other_s']:.1f} s, stolen {cpu['steal_s']:.1f} s")
