"""Model tests: calibrations measured with one torch thread."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Calibrate with one torch thread: on a shared 2-core machine a second OpenMP thread waits for a
    busy core and a 10 us call reads ~10 ms (the key records the thread count either way)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
