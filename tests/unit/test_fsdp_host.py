"""FSDP2's reduce-scatter on a CPU mesh (``strategies/fsdp/host.py``), on a one-process group.

What a reduce-scatter gives this rank, and the input's storage freed at once;
the four-rank equivalence (``tests/distributed/test_sharded_strategies.py``) and
the 1 GB memory test (``tests/launch/test_big_model_memory.py``) run it for real.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from manygpu.strategies.fsdp.host import InPlaceReduceScatter


@pytest.fixture
def group() -> object:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "op",
    [dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX],  # MAX: gloo's own reduce-scatter
    ids=["sum", "avg", "max"],
)
def test_this_ranks_rows_come_out_and_the_input_is_freed(group: object, op: object) -> None:
    comm = InPlaceReduceScatter()
    grads = comm.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))
    grads.copy_(torch.arange(6.0))
    out = torch.empty(6)
    assert comm(out, grads, group, op) is None  # type: ignore[arg-type]  # synchronous
    assert torch.equal(out, torch.arange(6.0))
    assert grads.untyped_storage().size() == 0  # FSDP2 keeps a reference; no bytes behind it
