"""CPU copies of state dicts in buffers that are allocated once and reused.

An asynchronous save must not write tensors the training loop goes on
changing, so it first copies them to CPU memory. Allocating that memory anew
at every save is the slow part (page faults; on a GPU machine, pinning
gigabytes takes seconds), so :class:`Staging` keeps one buffer per tensor slot
(same shape and dtype) and copies into it again at the next save. With CUDA
sources the buffers are pinned, every copy is issued ``non_blocking`` and one
synchronisation waits for them all: the GPU copies at full link speed while
the CPU only queues.

A staging area serves one save at a time: the caller must wait for the
previous save's background write before staging the next (the checkpointer
does: a new save first waits for the pending one).

DCP saves stage through torch's own stager instead (:meth:`Staging.dcp_stager`:
``DefaultStager``, which knows DTensors and keeps one CPU copy per source
storage, reused by every later save), held here so that its buffers live as
long as the checkpointer.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

_Key = tuple[tuple[int, ...], torch.dtype]


def pin_wanted(*, cuda_available: bool) -> bool:
    """Whether staging buffers are pinned: only where CUDA can use pinned memory."""
    return cuda_available


class Staging:
    """Reusable CPU buffers, one per (shape, dtype) slot of the states staged.

    Args:
        pin: allocate page-locked buffers (fast, asynchronous device-to-host
            copies); only meaningful, and only allowed, with CUDA.
    """

    def __init__(self, *, pin: bool = False) -> None:
        self.pin = pin
        self._pool: dict[_Key, list[torch.Tensor]] = defaultdict(list)
        self._used: dict[_Key, int] = defaultdict(int)
        self._seen: dict[tuple[Any, ...], torch.Tensor] = {}
        self._from_cuda = False
        self._dcp: Any = None
        self.allocated = 0
        """Buffers allocated so far (stays put once every shape has been seen)."""

    def dcp_stager(self) -> Any:
        """torch's ``AsyncStager`` for ``dcp.async_save``, made once and reused across saves.

        It copies synchronously (the save returns only when the copy is done),
        into pinned memory with non-blocking copies when :attr:`pin`.
        """
        if self._dcp is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._dcp = DefaultStager(
                StagingOptions(
                    use_pinned_memory=self.pin,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=self.pin,
                )
            )
        return self._dcp

    def close(self) -> None:
        """Let every buffer go (torch's stager included)."""
        if self._dcp is not None:
            self._dcp.close()
            self._dcp = None
        self._pool.clear()
        self._seen.clear()

    def stage(self, trees: dict[str, Any]) -> dict[str, Any]:
        """Copies of ``trees`` (name -> state dict) whose tensors live in our buffers.

        The structure (dicts, lists, tuples) is rebuilt, so later changes to the
        live containers do not reach the copy either; other leaves (numbers,
        strings) are immutable and kept as they are.
        """
        self._used.clear()
        self._seen.clear()
        self._from_cuda = False
        staged = {name: self._tree(tree) for name, tree in trees.items()}
        if self._from_cuda:  # one wait for every non-blocking copy
            torch.cuda.synchronize()
        self._seen.clear()
        return staged

    def _tree(self, tree: Any) -> Any:
        if isinstance(tree, torch.Tensor):
            return self._tensor(tree)
        if isinstance(tree, dict):
            return {k: self._tree(v) for k, v in tree.items()}
        if isinstance(tree, list | tuple):
            return type(tree)(self._tree(v) for v in tree)
        return tree

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if type(tensor) is not torch.Tensor or tensor.is_sparse:  # DTensor, sparse: copy as is
            return tensor.to("cpu", copy=True)
        # Two views of one storage (tied weights) stay one tensor in the file.
        alias = (tensor.device, tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.stride())
        if alias in self._seen:
            return self._seen[alias]
        buffer = self._buffer(tuple(tensor.shape), tensor.dtype)
        cuda = tensor.device.type == "cuda"
        buffer.copy_(tensor, non_blocking=cuda and self.pin)
        self._from_cuda = self._from_cuda or cuda
        self._seen[alias] = buffer
        return buffer

    def _buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (shape, dtype)
        slot = self._used[key]
        self._used[key] = slot + 1
        buffers = self._pool[key]
        if slot == len(buffers):
            buffers.append(torch.empty(shape, dtype=dtype, pin_memory=self.pin))
            self.allocated += 1
        return buffers[slot]
