"""Run untrusted Python in a child process with limits: the code environment's runner.

    run_python(program, stdin, limits) -> Outcome

What is enforced, for every run:
  process      a fresh interpreter, `python -I -S` (isolated mode: no PYTHON* variables, no user or
               site packages, no cwd on sys.path), in its own session and process group; the whole
               group is SIGKILLed when the run ends or overruns, before the child is reaped, and the
               child is SIGKILLed if the thread that ran it dies first (Linux PR_SET_PDEATHSIG: a
               scoring worker killed for a timeout takes its sandbox run along)
  time         wall clock (`wall_s`, checked by the parent) and CPU time (RLIMIT_CPU)
  memory       address space (RLIMIT_AS): a big allocation fails with MemoryError
  processes    RLIMIT_NPROC (default 1: no fork, no threads), so no fork bomb and nothing outlives
               the group kill. Linux does not apply it to root, so when the scorer runs as root the
               child runs as the unprivileged user `nobody` (see `isolation()`)
  files        a fresh temporary working directory (HOME and TMPDIR too), deleted afterwards; every
               file the child writes, stdout and stderr included, is capped at `file_bytes`
               (RLIMIT_FSIZE: a write past it fails with EFBIG); only `shown_bytes` of each comes back
  environment  nothing inherited: PATH, HOME, TMPDIR and LC_ALL only, so no secrets from ours
  network      in its own network namespace (`unshare -Un`: no interfaces up, loopback included),
               when the machine allows unprivileged user namespaces (probed once); always, in
               process, `socket.socket`, `socket.create_connection` and friends raise OSError

What is not: this is not a security boundary against a determined attacker. The child shares the
host's kernel and filesystem view: it can read any world-readable file, and fill the disk with
many files below the per-file cap until the time limit. Without the network namespace, the socket
block is in-process only (ctypes or `_socket` internals can get around it), so services on
loopback (Redis, the server) are reachable. Run hostile workloads in a container or VM.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import pwd
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

log = logging.getLogger("specrl.trainer.envs")

_PATH = "/usr/local/bin:/usr/bin:/bin"
# Runs before every program, in the child: the in-process network block.
_PRELUDE = """\
import socket as _socket_module, _socket
def _no_network(*args, **kwargs):
    raise OSError(101, "network access is disabled in the sandbox")
for _name in ("socket", "SocketType", "create_connection", "create_server", "socketpair", "fromfd",
              "getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
    setattr(_socket_module, _name, _no_network)
    setattr(_socket, _name, _no_network)
del _name
"""
_PROBE = """\
import os
open("probe", "w").write("ok")
try:
    pid = os.fork()
except OSError:
    print("probe-ok fork-blocked")
else:
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    print("probe-ok fork-allowed")
"""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 5.0                 # wall clock for the whole run, interpreter start included
    cpu_s: int = 5                      # RLIMIT_CPU (SIGXCPU, then SIGKILL one second later)
    memory_bytes: int = 512 << 20       # RLIMIT_AS
    processes: int = 1                  # RLIMIT_NPROC; 1 = the child alone (no fork, no threads)
    file_bytes: int = 1 << 20           # RLIMIT_FSIZE: any one file, stdout and stderr included
    open_files: int = 64                # RLIMIT_NOFILE
    shown_bytes: int = 4096             # how much of stdout and stderr comes back in the Outcome


@dataclass(frozen=True)
class Outcome:
    returncode: int                     # negative: killed by that signal
    timed_out: bool                     # killed by the wall-clock limit
    elapsed_s: float
    stdout: str                         # the first shown_bytes, decoded with errors replaced
    stderr: str
    results: str                        # what the program wrote to its results file (fd in sys.argv[1])
    output_truncated: bool              # stdout or stderr was longer than shown_bytes

    @property
    def failure(self) -> str | None:
        """Why the run did not finish normally, in words; None when it exited with status 0."""
        if self.timed_out:
            return f"timeout: killed after {self.elapsed_s:.1f}s of wall clock"
        if self.returncode < 0:
            name = signal.Signals(-self.returncode).name if -self.returncode in signal.valid_signals() else "?"
            cause = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (a resource limit)"}.get(name, "")
            return f"killed by {name}{cause}"
        if self.returncode != 0:
            return f"exited with status {self.returncode}: {self.stderr.strip()[-300:]}"
        return None


@dataclass(frozen=True)
class Isolation:
    """How this machine runs sandboxed children, found by `isolation()`."""

    python: str                         # the interpreter the child runs
    user: str                           # the user it runs as
    uid: int | None                     # None: the scorer's own user
    gid: int | None
    prefix: tuple[str, ...]             # ("unshare", "-Un", "--") or ()
    processes_limited: bool             # RLIMIT_NPROC holds for the child (probed with one fork)

    @property
    def network(self) -> str:
        return "network namespace + in-process socket block" if self.prefix else "in-process socket block only"


def run_python(program: str, stdin: bytes = b"", limits: Limits = Limits()) -> Outcome:
    """Run `program` (Python source) in a sandboxed child under `limits`; never raises for its faults.

    The program reads `stdin`, and writes what the parent should read to the results file whose
    descriptor is int(sys.argv[1]). Anything it prints goes to (capped) stdout/stderr.
    """
    return _execute(isolation(), program, stdin, limits)


def _execute(iso: Isolation, program: str, stdin: bytes, limits: Limits) -> Outcome:
    work = tempfile.mkdtemp(prefix="specrl-sandbox-")          # the child's cwd, HOME and TMPDIR
    private = tempfile.mkdtemp(prefix="specrl-sandbox-io-")     # stdin/stdout/stderr/results: ours only
    try:
        if iso.uid is not None:
            os.chown(work, iso.uid, iso.gid)
        paths = {name: os.path.join(private, name) for name in ("stdin", "stdout", "stderr", "results")}
        with open(paths["stdin"], "wb") as f:
            f.write(stdin)
        with open(paths["stdin"], "rb") as f_in, open(paths["stdout"], "wb") as f_out, \
                open(paths["stderr"], "wb") as f_err, open(paths["results"], "wb") as f_res:
            started = time.monotonic()
            command = [*iso.prefix, iso.python, "-I", "-S", "-c", _PRELUDE + program, str(f_res.fileno())]
            timed_out, returncode = _run(iso, command, work, limits, (f_in, f_out, f_err, f_res), started)
            elapsed = time.monotonic() - started
        stdout, cut_out = _head(paths["stdout"], limits.shown_bytes)
        stderr, cut_err = _head(paths["stderr"], limits.shown_bytes)
        results, _ = _head(paths["results"], limits.file_bytes)
        return Outcome(returncode, timed_out, elapsed, stdout, stderr, results, cut_out or cut_err)
    finally:
        _remove_tree(work)
        _remove_tree(private)


def _run(iso: Isolation, command: list[str], cwd: str, limits: Limits, files: tuple, started: float
         ) -> tuple[bool, int]:
    """Start the child, wait up to wall_s, kill its process group: (timed_out, returncode)."""
    f_in, f_out, f_err, f_res = files
    env = {"PATH": _PATH, "HOME": cwd, "TMPDIR": cwd, "LC_ALL": "C.UTF-8"}
    user = {} if iso.uid is None else {"user": iso.uid, "group": iso.gid, "extra_groups": []}
    proc = subprocess.Popen(command, stdin=f_in, stdout=f_out, stderr=f_err, cwd=cwd, env=env, close_fds=True,
                            pass_fds=(f_res.fileno(),), start_new_session=True, umask=0o077,
                            preexec_fn=_rlimits(limits), **user)
    exited = _wait_unreaped(proc.pid, started + limits.wall_s)
    try:                                   # the leader is unreaped, so its group id cannot have been reused
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return not exited, proc.wait()


def _rlimits(limits: Limits):
    """The preexec_fn: setrlimit calls on precomputed values and the parent-death signal (no imports,
    no locks after fork). It runs after the switch to the sandbox user, which would clear the latter."""
    values = ((resource.RLIMIT_AS, limits.memory_bytes), (resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1)),
              (resource.RLIMIT_NPROC, limits.processes), (resource.RLIMIT_FSIZE, limits.file_bytes),
              (resource.RLIMIT_NOFILE, limits.open_files), (resource.RLIMIT_CORE, 0))
    values = tuple((which, _within_hard(which, v if isinstance(v, tuple) else (v, v))) for which, v in values)

    def apply() -> None:
        for which, value in values:
            resource.setrlimit(which, value)
        die_with_parent()

    return apply


def die_with_parent() -> None:
    """Linux: have this process SIGKILLed when the thread that started it ends (PR_SET_PDEATHSIG), even
    when its parent is SIGKILLed; elsewhere nothing. Safe in a preexec_fn: no imports, no locks."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, _SIGKILL)


def _libc_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):       # not Linux: the wall-clock kill is the only one
        return None


_PR_SET_PDEATHSIG, _SIGKILL = 1, int(signal.SIGKILL)
_PRCTL = _libc_prctl()


def _within_hard(which: int, value: tuple[int, int]) -> tuple[int, int]:
    """(soft, hard) lowered to our own hard limit, which a child cannot exceed."""
    hard = resource.getrlimit(which)[1]
    if hard == resource.RLIM_INFINITY:
        return value
    return min(value[0], hard), min(value[1], hard)


def _wait_unreaped(pid: int, deadline: float) -> bool:
    """Wait until the child exits (True) or the deadline passes (False), without reaping it."""
    delay = 0.001
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(delay, left))
        delay = min(2 * delay, 0.02)


def _head(path: str, n: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(n + 1)
    return data[:n].decode("utf-8", errors="replace"), len(data) > n


def _remove_tree(path: str) -> None:
    """Delete a sandbox directory, even one whose child made parts of it unreadable."""
    try:
        shutil.rmtree(path)
        return
    except FileNotFoundError:
        return
    except OSError:
        pass
    os.chmod(path, 0o700)                   # the child is dead: nothing changes under us now
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            full = os.path.join(root, name)
            if not os.path.islink(full):
                os.chmod(full, 0o700)
    shutil.rmtree(path, ignore_errors=True)


@functools.cache
def isolation() -> Isolation:
    """The strongest way to run children that works here, probed once per process.

    Tries, in order: as `nobody` when we are root (else as ourselves), in a network namespace
    (`unshare -Un`) or not, with this interpreter or the system's python3; the first that runs
    the probe wins. Logs one INFO line with the choice, and a WARNING when it is weak.
    """
    for iso in _candidates():
        outcome = _probe(iso)
        if outcome is not None and "probe-ok" in outcome.stdout:
            iso = Isolation(iso.python, iso.user, iso.uid, iso.gid, iso.prefix,
                            processes_limited="fork-blocked" in outcome.stdout)
            weak = [w for w, bad in (("runs as root", iso.uid is None and os.geteuid() == 0),
                                     ("no network namespace", not iso.prefix),
                                     ("RLIMIT_NPROC not enforced", not iso.processes_limited)) if bad]
            (log.warning if weak else log.info)(
                "event=sandbox_isolation python=%s user=%s network=%r processes_limited=%s weak=%r",
                iso.python, iso.user, iso.network, iso.processes_limited, weak)
            return iso
    raise RuntimeError("no way to run a sandboxed Python child on this machine (see the specrl.trainer.envs log)")


def _candidates() -> list[Isolation]:
    users: list[tuple[str, int | None, int | None]] = []
    if os.geteuid() == 0:
        try:
            nobody = pwd.getpwnam("nobody")
            users.append(("nobody", nobody.pw_uid, nobody.pw_gid))
        except KeyError:
            pass
    users.append((pwd.getpwuid(os.geteuid()).pw_name, None, None))
    prefixes = [("unshare", "-Un", "--")] if shutil.which("unshare") else []
    prefixes.append(())
    pythons = []                           # ours, else the system's (ours may sit where `nobody` cannot read)
    for path in (sys.executable, os.path.realpath(sys.executable), getattr(sys, "_base_executable", None),
                 shutil.which("python3", path=_PATH)):
        if path and path not in pythons:
            pythons.append(path)
    return [Isolation(python, name, uid, gid, prefix, False)
            for name, uid, gid in users for prefix in prefixes for python in pythons]


def _probe(iso: Isolation) -> Outcome | None:
    """Run the probe program with `iso`; None if the child cannot even start."""
    try:
        return _execute(iso, _PROBE, b"", Limits(wall_s=10.0))
    except OSError as exc:
        log.debug("event=sandbox_probe_failed python=%s user=%s prefix=%s error=%r", iso.python, iso.user,
                  iso.prefix, exc)
        return None
