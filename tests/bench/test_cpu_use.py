"""`cpu_use`: CPU seconds of named process trees, the rest of the machine, and steal, over a window."""

import os
import subprocess
import sys
import time

import pytest

from specrl.apps.bench import cpu_use

# burns about `seconds` of CPU in a grandchild, which ends (and is waited for) before the parent reads stdin
SPIN_IN_GRANDCHILD = """
import subprocess, sys
spin = "import time\\nend = time.process_time() + {seconds}\\nwhile time.process_time() < end: pass"
subprocess.run([sys.executable, "-c", spin], check=True)
sys.stdin.read()
"""


def test_a_process_tree_counts_its_descendants_cpu_live_or_ended():
    parent = subprocess.Popen([sys.executable, "-c", SPIN_IN_GRANDCHILD.format(seconds=0.6)], stdin=subprocess.PIPE)
    try:
        before = cpu_use.snapshot({"tree": parent.pid, "meter": os.getpid()})
        deadline = time.monotonic() + 60
        while (cpu_use.snapshot({"tree": parent.pid}).processes["tree"] or 0) - before.processes["tree"] < 0.5:
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.2)  # the grandchild has ended by now, or ends: its seconds must not vanish with it
        after = cpu_use.snapshot({"tree": parent.pid, "meter": os.getpid()})
    finally:
        parent.communicate(b"")
    use = cpu_use.use(before, after)
    assert use["tree_s"] >= 0.5  # the grandchild's: the parent's own times do not hold them
    assert use["meter_s"] < use["tree_s"]  # this process slept
    assert use["busy_s"] + use["steal_s"] <= use["wall_s"] * use["cores"] * 1.05 + 0.05
    assert use["busy_s"] >= 0.9 * (use["tree_s"] + use["meter_s"]) - 0.05
    assert use["other_s"] == pytest.approx(max(0.0, use["busy_s"] - use["tree_s"] - use["meter_s"]))


def test_a_gone_process_reads_none_and_is_named_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    before = cpu_use.snapshot({"child": child.pid})
    child.wait()
    use = cpu_use.use(before, cpu_use.snapshot({"child": child.pid}))
    assert use["child_s"] is None
    line = cpu_use.describe(use)
    assert line.startswith("cpu over ") and "child gone" in line and "stolen" in line


def test_a_named_descendant_counts_under_its_own_name_only():
    """The meter starts the server: the server's CPU is the server's, not the meter's as well."""
    parent = subprocess.Popen([sys.executable, "-c", SPIN_IN_GRANDCHILD.format(seconds=0.4)], stdin=subprocess.PIPE)
    try:
        pids = {"meter": os.getpid(), "server": parent.pid}
        before = cpu_use.snapshot(pids)
        deadline = time.monotonic() + 60
        while (cpu_use.snapshot(pids).processes["server"] or 0) - before.processes["server"] < 0.3:
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        use = cpu_use.use(before, cpu_use.snapshot(pids))
    finally:
        parent.communicate(b"")
    assert use["server_s"] >= 0.3 and use["meter_s"] < 0.2
