"""Ring, parameter-server and tree all-reduce against the backend's, as properties.

Every rank runs the same derandomized hypothesis examples (no shrinking, so
ranks never diverge): sizes including 0, 1 and sizes not divisible by the
world size, several dtypes. Integers must match exactly; floats within
rtol 1e-5 (float32) / 1e-12 (float64), since summation order differs.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import preload, run_ranks
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from manygpu import Parallel, comm
from manygpu.comm.algorithms import ALGORITHMS

DTYPES = ["float32", "float64", "int32", "int64"]
preload("hypothesis")


def _local_input(size: int, dtype: str, rank: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    if dtype.startswith("int"):
        return torch.randint(-1000, 1000, (size,), generator=gen).to(getattr(torch, dtype))
    return torch.randn(size, generator=gen, dtype=getattr(torch, dtype)) * 10


def _property_run() -> int:
    par = Parallel(strategy="ddp", timeout_s=30)
    checked = [0]
    try:
        n = par.world_size

        @settings(
            derandomize=True,
            max_examples=12,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
        )
        @given(
            size=st.integers(0, 3000),
            dtype=st.sampled_from(DTYPES),
            seed=st.integers(0, 2**16),
            shape2d=st.booleans(),
        )
        @example(size=0, dtype="float32", seed=1, shape2d=False)
        @example(size=1, dtype="int64", seed=2, shape2d=False)
        @example(size=n + 1, dtype="float64", seed=3, shape2d=False)
        def check(size: int, dtype: str, seed: int, shape2d: bool) -> None:
            base = _local_input(size, dtype, par.rank, seed)
            if shape2d and size % 2 == 0:
                base = base.reshape(2, size // 2)
            expected = comm.all_reduce(base.clone(), "sum")
            for name, algorithm in ALGORITHMS.items():
                got = algorithm(base.clone(), timeout_s=30)
                assert got.shape == base.shape and got.dtype == base.dtype, name
                if dtype.startswith("int"):
                    assert torch.equal(got, expected), name
                else:
                    rtol = 1e-5 if dtype == "float32" else 1e-12
                    assert torch.allclose(got, expected, rtol=rtol, atol=rtol * 100), name
            checked[0] += 1

        check()
        return checked[0]
    finally:
        par.close()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_algorithms_match_native_all_reduce(world: int) -> None:
    counts = run_ranks(_property_run, world, timeout=150)
    assert counts[0] >= 12 and len(set(counts)) == 1
