"""Child processes of specrl commands (`specrl up`, benchmarks, tests): spawn `specrl <command>`
on a loopback port, wait until it answers /health, stop it with SIGTERM."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from specrl.errors import SpecrlError

log = logging.getLogger("specrl.apps.launch")


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range. Why not bind(0): that hands out
    an ephemeral port, which any outgoing connection (a Redis client, an HTTP request) may take as its
    own local port while a server loads for half a minute before it binds: a vLLM server in CI died
    with "address already in use" that way."""
    below = range(max(1024, _ephemeral_low() - 12000), _ephemeral_low())
    for port in random.sample(below, min(200, len(below))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise SpecrlError("no free loopback port below the ephemeral range")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def shared_threads(threads: int, processes: int) -> int:
    """Torch threads for each of `processes` busy processes on this machine: `threads` when set (> 0),
    else the cores split between them (at least 1). Each process defaulting to every core
    oversubscribes them, and OpenMP teams then wait on each other: `specrl rl` on 2 cores generated
    at 9.5 tok/s while the server, the drafter trainer and GRPO each ran 2 threads, against 150 tok/s
    for the same server alone. Set threads that oversubscribe the cores are kept, with a warning: `--threads 2`
    gave each of `specrl rl`'s three processes two threads on 2 cores and its rollouts ran 4.6x slower."""
    cores = os.cpu_count() or 1
    if threads > 0 and threads * processes > cores:
        log.warning("--threads %d is per process: %d busy processes x %d threads = %d on %d cores oversubscribes "
                    "them (leave --threads unset to split the cores)", threads, processes, threads,
                    threads * processes, cores)
    return threads if threads > 0 else max(1, cores // processes)


def spawn(args: list[str], env: dict, log: Path, *, nice: int = 0) -> subprocess.Popen:
    """Run `specrl <args>` with its output (stdout and stderr) in `log`; `nice` > 0 lowers its CPU priority by that
    much below this process's (set right after it starts, before it has made any thread: its threads inherit it)."""
    proc = subprocess.Popen([sys.executable, "-m", "specrl.apps.cli", *args], env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    if nice > 0:
        with contextlib.suppress(ProcessLookupError):   # it may already have exited
            os.setpriority(os.PRIO_PROCESS, proc.pid, min(os.getpriority(os.PRIO_PROCESS, 0) + nice, 19))
    return proc


def start_server(args: list[str], env: dict, log: Path, *, host: str = "127.0.0.1", port: int | None = None,
                 timeout_s: float = 300) -> tuple[subprocess.Popen, str]:
    """`specrl serve <args>` on `host`:`port` (a free loopback port when None), waited for until it answers
    /health -> (the process, its URL). One that dies or never answers is stopped and raises SpecrlError."""
    port = port or free_port()
    url = f"http://{host}:{port}"
    proc = spawn(["serve", *args, "--host", host, "--port", str(port)], env, log)
    try:
        wait_healthy(url, proc, log, timeout_s)
    except BaseException:
        terminate(proc)
        raise
    return proc, url


@contextlib.contextmanager
def running_server(args: list[str], env: dict, log: Path, **where) -> Iterator[str]:
    """`start_server` for the length of a `with` block -> the server's URL; stopped on exit."""
    proc, url = start_server(args, env, log, **where)
    try:
        yield url
    finally:
        terminate(proc)


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    """Block until `url`/health answers 200; SpecrlError naming the log if the process dies or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SpecrlError(f"the server exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    terminate(proc)
    raise SpecrlError(f"the server did not answer /health within {timeout_s:.0f} s; see {log}")


def terminate(proc: subprocess.Popen, timeout_s: float = 60, sig: int = signal.SIGTERM) -> int:
    """Signal, wait up to `timeout_s`, then kill. -> the exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
