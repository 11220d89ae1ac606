"""FSDP2 on a CPU mesh: each rank's host memory held to its share plus one block.

On a GPU, FSDP2 overlaps its collectives with compute and its buffers live in
the caching allocator; on a CPU mesh (gloo) they live in the process's heap,
and three of FSDP2's defaults cost resident memory there while buying nothing.
Measured on a 1 GB GPT (34 blocks) under fsdp at 4 CPU ranks
(``bench/prepare_memory.py``), each rank's backward peaked at 0.77x the model
over 0.5x of sharded parameters and gradients; these bring it to 0.66x:

- **Backward prefetch** gathers the next block while the current one computes.
  On a CPU mesh the all-gather is synchronous (FSDP2's ``unshard_async_op`` is
  off), so the prefetch overlaps nothing and only holds one more gathered
  block: each unit is set to prefetch itself, which is no work (0.77x -> 0.75x).
- **gloo's reduce-scatter** copies its whole input into a buffer of its own,
  and FSDP2 keeps each reduce-scatter's input until the next one (for the
  stream ordering a GPU needs): two more whole blocks. gloo's all-reduce works
  in place (2 MB of its own for a 28 MB block, and it was faster: 79 ms
  against 102 ms per block on dev-2c), so :class:`InPlaceReduceScatter`
  all-reduces the input where it is, copies this rank's rows out and frees the
  input's storage at once (0.75x -> 0.72x).
- **Freed activations stay resident.** A block's activations and temporaries
  are small heap allocations (below the mmap threshold that
  :mod:`manygpu.runtime.host_memory` fixes), freed during the backward between
  live ones, so glibc keeps them; ``malloc_trim`` after each block's
  reduce-scatter hands them back (0.72x -> 0.66x), about 1.3 ms a block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

# FSDP2's interface for a custom reduce-scatter (``FSDPModule.set_custom_reduce_scatter``),
# not re-exported by torch.distributed.fsdp.
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from manygpu.runtime.host_memory import release_host_memory

IN_PLACE_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
"""The ops FSDP2 asks of gloo for fp32/bf16 gradients; others (a pre-multiplied sum)
take gloo's own reduce-scatter, still freed at once."""


class InPlaceReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter on a CPU mesh, without whole-block copies.

    The all-reduce sums every rank's whole input in place (the same values a
    reduce-scatter gives this rank's rows), then the input's storage is freed:
    the collective is synchronous on a CPU mesh, so nothing reads it later,
    though FSDP2 keeps a reference until the next block.
    """

    def allocate(
        self,
        size: Sequence[int | torch.SymInt],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        if op in IN_PLACE_OPS:
            dist.all_reduce(input_tensor, op=op, group=group)
            rows = input_tensor.view(group.size(), -1)
            output_tensor.copy_(rows[dist.get_rank(group)])
        else:
            dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group)
        input_tensor.untyped_storage().resize_(0)
        release_host_memory()  # this block's freed activations and buffers
        return None


def keep_host_memory_low(units: Sequence[nn.Module]) -> None:
    """FSDP2 units on a CPU mesh: no backward prefetch, :class:`InPlaceReduceScatter`.

    A unit that names itself as the one to prefetch replaces FSDP2's default
    (the next unit in reverse forward order) with a no-op: it is already
    gathered when its backward starts. A user's own
    ``set_modules_to_backward_prefetch`` afterwards still wins.
    """
    comm = InPlaceReduceScatter()
    for unit in units:
        if isinstance(unit, FSDPModule):
            unit.set_modules_to_backward_prefetch([unit])
            unit.set_custom_reduce_scatter(comm)
