"""The job's collectives on :class:`~manygpu.Parallel`: reduce, gather, barrier, and its mesh.

One part of ``Parallel``, given what it needs when built: the device, the
timeout, the debug setting and (asked for on use: ``"auto"`` may choose again
in ``prepare``) the strategy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from manygpu import comm
from manygpu.errors import UsageError
from manygpu.strategies.sharded import device_mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from manygpu.strategies.base import Strategy


class JobCollectives:
    """Collectives over the job's ranks, or over one dimension of its mesh."""

    def __init__(
        self,
        *,
        strategy: Callable[[], Strategy[Any]],
        device: torch.device,
        timeout_s: float,
        debug: bool | None,
    ) -> None:
        self._strategy, self._debug = strategy, debug
        self.device, self.timeout_s = device, timeout_s

    @property
    def mesh(self) -> DeviceMesh:
        """The job's device mesh (a torch ``DeviceMesh``), built once, its dimensions named.

        The one every strategy uses: ``pp``, ``dp``, ``fsdp``, ``tp`` as the
        strategy composes them (``par.mesh.mesh_dim_names``); a 1-D ``dp`` mesh
        over the ranks for one that replicates. ``par.mesh["tp"]`` is a named
        sub-mesh, ``par.mesh.get_local_rank("dp")`` this rank's data index.
        """
        return device_mesh(self._strategy())

    def reduce(
        self, tensor: torch.Tensor, op: comm.ReduceOp = "mean", *, over: str | None = None
    ) -> torch.Tensor:
        """A new tensor: ``tensor`` reduced over every rank, or over one mesh dimension.

        ``op`` is ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``; the input is left
        alone. ``over="tp"`` reduces among the ranks that differ only in that
        dimension of :attr:`mesh` (e.g. a metric over a tensor-parallel group).
        """
        group = self._group(over) if over is not None else None
        # NCCL takes CUDA tensors only: a CPU scalar (a metric) travels via our device.
        work = tensor.detach().to(self.device, copy=True)
        out = comm.all_reduce(work, op, timeout_s=self.timeout_s, debug=self._debug, group=group)
        return out.to(tensor.device)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0, in rank order."""
        work = tensor.detach().to(self.device)
        out = comm.all_gather(work, timeout_s=self.timeout_s, debug=self._debug)
        return out.to(tensor.device)

    def barrier(self) -> None:
        """Wait for every rank (bounded by the timeout; names missing ranks on gloo)."""
        comm.barrier(timeout_s=self.timeout_s, debug=self._debug)

    def _group(self, over: str) -> Any:
        mesh = self.mesh
        names = mesh.mesh_dim_names or ()
        if over not in names:
            raise UsageError(
                f"reduce(over={over!r}): this job's mesh has dimension(s) "
                f"{', '.join(names)}; reduce over one of them, or over every rank (no over=)"
            )
        return mesh.get_group(over)
