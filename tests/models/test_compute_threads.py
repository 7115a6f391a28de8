"""release_compute_threads: the calling thread's OpenMP workers exit, other threads' stay."""

import os
import threading

import pytest
import torch

from specrl.models.compute_threads import release_compute_threads
from specrl.models.linear import PackedLinear

pytest.importorskip("specrl.models._cpu_kernels", reason="the stream kernel is not built")


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_region(threads: int) -> None:
    """One OpenMP region of `threads` threads (the stream kernel's), in the calling thread."""
    weight = PackedLinear(torch.randn(64, 32), "blocked", (1,), ("stream",))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the stream kernel takes torch's count
    try:
        weight(torch.randn(1, 32))
    finally:
        torch.set_num_threads(before)


def _in_thread(fn):
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def test_release_ends_the_calling_threads_workers_only():
    def computing_thread() -> tuple[int, int, bool, int, int]:
        _parallel_region(3)  # a team of 3: this thread and 2 pool workers
        with_pool = _os_threads()
        released = release_compute_threads()
        after = _os_threads()
        _parallel_region(3)  # computing again builds a new pool
        again = _os_threads()
        release_compute_threads()
        return with_pool, after, released, again, _os_threads()

    _parallel_region(2)  # the main thread's own pool (1 worker) must survive the other thread's release
    baseline = _os_threads()
    with_pool, after, released, again, released_again = _in_thread(computing_thread)
    assert released
    assert with_pool == baseline + 1 + 2  # the computing thread and its two workers
    assert after == baseline + 1
    assert again == baseline + 1 + 2
    assert released_again == baseline + 1
