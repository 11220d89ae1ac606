"""Sparse all-reduce: gather every rank's indices and values, keep the result sparse.

A sparse gradient (``nn.Embedding(sparse=True)``) touches a few rows of a
large table; summing it densely would send the whole table. As Horovod does,
the ranks all-gather their COO indices and values instead and build one
uncoalesced sparse tensor of every rank's entries (duplicates add up when it
is coalesced, which is the sum); ``Average`` divides the values by the number
of processes. Optimizers that need sparse gradients (``torch.optim.SparseAdam``)
then see a sparse gradient, as in one process.

Indices and values travel flattened to one dimension, so a rank that has no
gradient for a parameter can take part (it sends nothing) without knowing the
gradient's layout; the layout is read back from the counts received (see
:func:`_sparse_dim`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from manygpu.errors import UsageError
from manygpu.horovod import pending
from manygpu.horovod.basics import session
from manygpu.horovod.data_ops import allgather_async
from manygpu.horovod.handles import synchronize
from manygpu.horovod.reduce_ops import ReduceOp, resolve_op
from manygpu.horovod.reports import describe


class SparseHandle(int):
    """A started sparse all-reduce: ``hvd.synchronize(handle)``, or call it, for the result.

    Horovod's ``sparse_allreduce_async`` returns a function to call; this
    handle is also an ordinary integer handle, so ``hvd.synchronize`` and
    ``hvd.poll`` take it like any other.
    """

    def __call__(self) -> torch.Tensor | None:
        result: torch.Tensor | None = synchronize(int(self))
        return result


def _sparse_dim(shape: torch.Size, n_indices: int, n_values: int) -> int:
    """The sparse dimensions ``k`` that split ``n_indices``/``n_values`` into ``nnz`` entries.

    ``n_indices = nnz * k`` and ``n_values = nnz * prod(shape[k:])``; the ratio
    ``k / prod(shape[k:])`` grows strictly with ``k``, so at most one ``k`` fits.
    """
    for k in range(1, len(shape) + 1):
        if n_indices * math.prod(shape[k:]) == k * n_values:
            return k
    raise UsageError(
        f"sparse allreduce: ranks sent sparse tensors of shape {tuple(shape)} with different "
        "sparse dimensions; coalesce them the same way on every rank"
    )


def _assemble(
    indices: torch.Tensor, values: torch.Tensor, like: torch.Tensor, sparse_dim: int | None
) -> torch.Tensor:
    """Every rank's entries as one uncoalesced COO tensor shaped as ``like``."""
    shape, k = like.shape, sparse_dim
    if k is None:  # this rank sent nothing: read the layout from what arrived
        k = _sparse_dim(shape, indices.numel(), values.numel()) if values.numel() else 1
    # Checked (O(entries)): the indices came from other processes.
    return torch.sparse_coo_tensor(
        indices.view(-1, k).t(),
        values.view(-1, *shape[k:]).to(like.dtype),
        shape,
        check_invariants=True,
    )


def _parts(tensor: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices (entry-major) and flat values to send; empty for no tensor."""
    if tensor is None:
        return torch.empty(0, dtype=torch.int64, device=like.device), like.new_empty(0)
    return tensor._indices().t().reshape(-1), tensor._values().reshape(-1)


def start(
    tensor: torch.Tensor | None,
    like: torch.Tensor,
    name: str | None,
    *,
    average: bool,
    process_set: object = None,
) -> SparseHandle:
    """Start gathering ``tensor``'s entries (``None``: this rank has none) shaped as ``like``.

    ``average`` divides the values by the number of processes in the set, as
    Horovod; no pre/postscale or compression applies to sparse tensors.
    """
    indices, values = _parts(tensor, like)
    label = name if name is not None else "sparse"
    # Values first, then indices: the order every rank starts (and waits for) them in.
    values_h = allgather_async(values, name=f"{label}.values", process_set=process_set)
    indices_h = allgather_async(indices, name=f"{label}.indices", process_set=process_set)
    s = session()
    size = s.topology.size if process_set is None else int(process_set.size())  # type: ignore[attr-defined]
    scale = 1.0 / size if average else 1.0
    k = None if tensor is None else tensor.sparse_dim()
    template = like if tensor is None else tensor

    def finish() -> torch.Tensor:
        gathered_values: torch.Tensor = synchronize(values_h)
        gathered_indices: torch.Tensor = synchronize(indices_h)
        if scale != 1.0:
            gathered_values = gathered_values * scale
        return _assemble(gathered_indices, gathered_values, template, k)

    inner = [pending.get(values_h), pending.get(indices_h)]
    works: list[dist.Work | None] = [w for p in inner if p for w in p.works]  # hvd.poll: both
    desc = describe("sparse_allreduce", template, name)
    seq = inner[0].seq if inner[0] is not None else 0
    return SparseHandle(pending.submit(works, finish, desc, seq))


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: object, process_set: object = None
) -> SparseHandle:
    """Start a sparse all-reduce of a COO ``tensor``; call the handle for the result.

    ``op`` is ``hvd.Average`` or ``hvd.Sum``. The result is an uncoalesced
    sparse tensor holding every rank's entries (Horovod's result).
    ``process_set`` (default: every process) is checked by the gathers.
    """
    rop = resolve_op(op, None)
    if rop not in (ReduceOp.Average, ReduceOp.Sum):
        raise UsageError(
            f"sparse_allreduce_async: op must be hvd.Average or hvd.Sum, not hvd.{rop.name} "
            "(entries are gathered and added up)"
        )
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        what = getattr(tensor, "layout", type(tensor).__name__)
        raise UsageError(
            f"sparse_allreduce_async needs a sparse COO tensor, got {what}; "
            "use hvd.allreduce for dense tensors (or tensor.to_sparse())"
        )
    return start(tensor, tensor, name, average=rop is ReduceOp.Average, process_set=process_set)
