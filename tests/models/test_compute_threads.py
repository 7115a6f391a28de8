"""release_compute_threads: the calling thread's OpenMP workers exit, other threads' stay."""

import os
import threading
import time

import pytest
import torch

from specrl.models.compute_threads import release_compute_threads
from specrl.models.linear import PackedLinear

pytest.importorskip("specrl.models._cpu_kernels", reason="the stream kernel is not built")


def _tids() -> set[int]:
    """The process's OS threads (by id): other tests' threads may come and go meanwhile, so the
    assertions below follow the ids of the workers they made, not a count."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def _gone(tids: set[int], timeout_s: float = 10.0) -> bool:
    """Whether these threads have exited: workers let go by omp_pause_soft exit on their own, after
    the call returns (the full suite on 2 cores once read one still there), so this waits for them."""
    deadline = time.monotonic() + timeout_s
    while tids & _tids():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


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
    def computing_thread() -> tuple[set[int], bool, bool, set[int], bool]:
        before = _tids()
        _parallel_region(3)  # a team of 3: this thread and 2 pool workers
        workers = _tids() - before
        released = release_compute_threads()
        gone = _gone(workers)
        before = _tids()
        _parallel_region(3)  # computing again builds a new pool
        again = _tids() - before
        release_compute_threads()
        return workers, released, gone, again, _gone(again)

    assert release_compute_threads()  # the main thread starts without a pool ...
    before = _tids()
    _parallel_region(2)  # ... and makes one (1 worker), which must survive the other thread's release
    main_pool = _tids() - before
    workers, released, gone, again, gone_again = _in_thread(computing_thread)
    assert released
    assert len(workers) == 2 and gone  # its two workers, then none
    assert len(again) == 2 and gone_again
    assert len(main_pool) == 1 and main_pool <= _tids()
