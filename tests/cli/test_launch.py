"""Launchers (`specrl up`, `specrl rl`) split the cores between the processes that compute at once."""

import os

from specrl.apps.launch import shared_threads, spawn


def test_busy_processes_split_the_cores_unless_threads_are_set():
    cores = os.cpu_count() or 1
    assert shared_threads(0, 2) == max(1, cores // 2)
    assert shared_threads(0, 3 * cores) == 1  # never 0
    assert shared_threads(3, 2) == 3  # --threads sets each process's own


def test_threads_that_oversubscribe_the_cores_are_kept_with_a_warning(caplog):
    cores = os.cpu_count() or 1
    with caplog.at_level("WARNING", logger="specrl.apps.launch"):
        assert shared_threads(1, cores) == 1  # exactly the cores: no warning
        assert caplog.records == []
        assert shared_threads(2, cores) == 2
    (record,) = caplog.records
    assert "per process" in record.getMessage() and f"{2 * cores} on {cores} cores" in record.getMessage()


def test_free_ports_are_bindable_and_below_the_ephemeral_range():
    """Outgoing connections take ephemeral ports: a server's port must not be one of them."""
    import socket

    from specrl.apps.launch import _ephemeral_low, free_port

    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < _ephemeral_low() for p in ports) and len(ports) > 1
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_spawn_lowers_the_priority_of_a_background_child(tmp_path):
    niced = spawn(["--help"], dict(os.environ), tmp_path / "niced.log", nice=10)
    plain = spawn(["--help"], dict(os.environ), tmp_path / "plain.log")
    try:
        # read while the child is alive or a zombie (not yet waited for): its priority is still there
        assert os.getpriority(os.PRIO_PROCESS, niced.pid) == min(os.getpriority(os.PRIO_PROCESS, 0) + 10, 19)
        assert os.getpriority(os.PRIO_PROCESS, plain.pid) == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        assert niced.wait(60) == 0 and plain.wait(60) == 0
    assert "usage" in (tmp_path / "niced.log").read_text()
