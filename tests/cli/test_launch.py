"""Launchers (`specrl up`, `specrl rl`) split the cores between the processes that compute at once."""

import os

from specrl.apps.launch import shared_threads


def test_busy_processes_split_the_cores_unless_threads_are_set():
    cores = os.cpu_count() or 1
    assert shared_threads(0, 2) == max(1, cores // 2)
    assert shared_threads(0, 3 * cores) == 1  # never 0
    assert shared_threads(3, 2) == 3  # --threads sets each process's own
