"""The kernel tests run on two threads at least: `make test` gives each pytest worker one (OMP_NUM_THREADS=1),
and the kernels split work across threads, so the multi-threaded paths must be what these tests check."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _at_least_two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)
