"""Hot-swap weights on a live `specrl serve` at a fixed rate, and log every swap.

    python loadtest/swap_driver.py --url http://127.0.0.1:8000 --token $SPECRL_ADMIN_TOKEN \
        --store <the server's --store> --model-dir <the served model's directory> --duration 20 --log swaps.jsonl

`prepare_versions` publishes (or reuses) two drafters and two policies in the weights store;
`run_swaps` then calls POST /admin/weights every `interval_s` seconds, cycling through the
roles (drafter, policy, drafter, ...) and, for policy swaps, through the modes (drain,
interrupt, ...), always to a version of the role that is not the one serving.

The log (JSON lines, flushed per line) starts with {"event": "start", "time", "serving"}
(the versions serving before the first swap, from /health) and has one line per swap:
{"event": "swap", "before", "after" (wall clock around the admin call), "role", "version",
"mode", "status" (HTTP status, 0 when the call itself failed), "response"}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

DRAFTERS = ("drafter-s1", "drafter-s2")  # EagleDrafter.day0 with seeds 1 and 2
POLICIES = ("policy-perturbed", "policy-base")  # the first swap changes the weights
SWAP_TIMEOUT_S = 120.0


def prepare_versions(store_root: Path | str, model_dir: Path | str, *, noise: float = 0.05) -> dict[str, list[str]]:
    """Publish two day-0 drafters and two policies (the model's files, and a copy with every
    tensor perturbed by `noise` x its standard deviation); versions already in the store are
    reused. -> {"drafter": [...], "policy": [...]} (version names)."""
    from specrl.models.drafter import EagleDrafter
    from specrl.models.llama import load_llama
    from specrl.weights import WeightsStore

    store, model_dir = WeightsStore(store_root), Path(model_dir)
    have = {role: {m.version for m in store.versions(role)} for role in ("drafter", "policy")}
    with tempfile.TemporaryDirectory(prefix="specrl-swaps-") as tmp:
        missing = [(seed, name) for seed, name in enumerate(DRAFTERS, start=1) if name not in have["drafter"]]
        if missing:
            target = load_llama(model_dir)
            for seed, name in missing:
                EagleDrafter.day0(target, seed=seed).save(Path(tmp) / name)
                _publish(store, "drafter", Path(tmp) / name, name)
            del target
        base, perturbed = POLICIES[1], POLICIES[0]
        if base not in have["policy"]:
            _publish(store, "policy", model_dir, base)
        if perturbed not in have["policy"]:
            _perturbed_copy(model_dir, Path(tmp) / perturbed, noise)
            _publish(store, "policy", Path(tmp) / perturbed, perturbed, parent=base)
    return {"drafter": list(DRAFTERS), "policy": list(POLICIES)}


def _publish(store, role: str, source: Path, version: str, parent: str | None = None) -> None:
    from specrl.weights.store import WeightsConflictError

    try:
        store.publish(role, source, version=version, parent=parent)
    except WeightsConflictError:
        pass  # a concurrent preparer published it first: reuse


def _perturbed_copy(model_dir: Path, out: Path, noise: float) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(3)
    for f in model_dir.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(str(f))
            for name, v in tensors.items():
                if v.is_floating_point() and v.numel() > 1:
                    scale = noise * v.float().std().item()
                    tensors[name] = (v.float() + scale * torch.randn(v.shape, generator=gen)).to(v.dtype)
            save_file(tensors, str(out / f.name), metadata={"format": "pt"})
        elif f.is_file() and f.name != "manifest.json":
            shutil.copy(f, out / f.name)


def run_swaps(url: str, token: str, versions: dict[str, list[str]], *, roles=("drafter", "policy"),
              modes=("drain", "interrupt"), interval_s: float = 2.0, duration_s: float = 20.0,
              log_path: Path | str | None = None, stop: threading.Event | None = None) -> list[dict]:
    """Swap every `interval_s` seconds (the first after one interval) until `duration_s` has
    passed or `stop` is set; -> the log entries (also appended to `log_path` when given).
    With no `roles` it only logs the start entry and returns."""
    stop = stop or threading.Event()
    headers = {"Authorization": f"Bearer {token}"}
    log = open(log_path, "a", buffering=1) if log_path else None
    entries: list[dict] = []

    def write(entry: dict) -> None:
        entries.append(entry)
        if log:
            log.write(json.dumps(entry) + "\n")
            log.flush()

    try:
        with httpx.Client(base_url=url, headers=headers, timeout=SWAP_TIMEOUT_S) as client:
            health = client.get("/health").json()
            serving = {"policy": health["target_version"], "drafter": health["drafter_version"]}
            write({"event": "start", "time": time.time(), "serving": dict(serving)})
            if not roles:  # nothing to swap: the log only records what serves
                return entries
            started, count, policy_swaps = time.monotonic(), 0, 0
            while not stop.wait(max(0.0, started + (count + 1) * interval_s - time.monotonic())):
                if time.monotonic() - started > duration_s:
                    break
                role = roles[count % len(roles)]
                mode = modes[policy_swaps % len(modes)] if role == "policy" else "drain"
                policy_swaps += role == "policy"
                version = _next_version(versions[role], serving[role])
                entry = swap(client, role, version, mode)
                if entry["status"] == 200:
                    serving[role] = version
                write(entry)
                count += 1
    finally:
        if log:
            log.close()
    return entries


def _next_version(cycle: list[str], serving: str) -> str:
    """The version after `serving` in `cycle` (the first when `serving` is not in it)."""
    return cycle[(cycle.index(serving) + 1) % len(cycle)] if serving in cycle else cycle[0]


def swap(client: httpx.Client, role: str, version: str, mode: str) -> dict:
    """One POST /admin/weights -> a swap log entry."""
    entry = {"event": "swap", "role": role, "version": version, "mode": mode, "before": time.time()}
    try:
        resp = client.post("/admin/weights", json={"role": role, "version": version, "mode": mode})
        entry["status"] = resp.status_code
        try:
            entry["response"] = resp.json()
        except ValueError:
            entry["response"] = resp.text[:500]
    except httpx.HTTPError as exc:
        entry["status"], entry["response"] = 0, f"{type(exc).__name__}: {exc}"
    entry["after"] = time.time()
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--token", required=True, help="the server's SPECRL_ADMIN_TOKEN")
    parser.add_argument("--store", required=True, help="the server's weights store root")
    parser.add_argument("--model-dir", required=True, help="the served model's directory (for the prepared versions)")
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--roles", default="drafter,policy")
    parser.add_argument("--modes", default="drain,interrupt")
    parser.add_argument("--log", default="swaps.jsonl")
    args = parser.parse_args(argv)
    versions = prepare_versions(args.store, args.model_dir)
    entries = run_swaps(args.url, args.token, versions, roles=tuple(args.roles.split(",")),
                        modes=tuple(args.modes.split(",")), interval_s=args.interval, duration_s=args.duration,
                        log_path=args.log)
    swaps = [e for e in entries if e["event"] == "swap"]
    ok = sum(e["status"] == 200 for e in swaps)
    print(f"swaps={len(swaps)} ok={ok} log={args.log}", file=sys.stderr)
    return 0 if ok == len(swaps) else 1


if __name__ == "__main__":
    sys.exit(main())
