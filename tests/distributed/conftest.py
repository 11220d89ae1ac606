"""One intra-op thread in the pytest process while a distributed test runs.

The references these tests compare with run in the pytest process, on tiny
models: with torch's default of one thread per core, each small op hands work
to an OpenMP team that spins waiting on busy cores (the suite keeps both busy),
which costs several times the op itself. The ranks already run with one thread
(OMP_NUM_THREADS=1, see dist_harness.py); the reference now does the same.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
