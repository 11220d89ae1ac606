"""Gradients all-reduced while backward runs: hooks, buckets, in-order launches, the wait.

Each parameter gets a hook that runs once its gradient has been accumulated
(``register_post_accumulate_grad_hook``). After ``backward_passes_per_step``
such passes the parameter is ready; a bucket whose parameters are all ready
is flattened (plus one flag per parameter saying whether this rank had a
gradient for it) and all-reduced asynchronously, so it travels while
backward computes the rest. Buckets are launched strictly in their order,
the same on every rank: NCCL and gloo match collectives by their order, not
by name as Horovod does. ``synchronize`` launches what backward did not
(parameters without a gradient send zeros and a zero flag), waits within the
collective timeout (a stall names the missing ranks), scales, and writes the
results back into ``.grad``. A parameter no rank had a gradient for keeps
``grad=None``, as in one process; one that some ranks had gets the average
over all ranks (the others counting as zero), as DDP does.

Sparse gradients (``nn.Embedding(sparse=True)``) are not summed in the
buckets: each parameter's second flag says some rank had a sparse gradient,
and after the buckets those are all-gathered as indices and values and stay
sparse (:mod:`manygpu.horovod.sparse`), as Horovod does, unless
``sparse_as_dense``. Deciding from the summed flags keeps every rank's
gathers in the same order, a rank without the gradient included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from manygpu.comm import debug as dbg
from manygpu.comm.common import active, debug_requested
from manygpu.errors import UsageError
from manygpu.horovod import sparse
from manygpu.horovod.basics import Scope, session
from manygpu.horovod.compression import Compressor
from manygpu.horovod.pending import Pending, wait_pending
from manygpu.horovod.process_sets import resolve
from manygpu.horovod.reports import next_call
from manygpu.horovod.stand_in import StepBeacon


class GradientSync:
    """The all-reduce side of a DistributedOptimizer (no optimizer logic here)."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        buckets: Sequence[Sequence[int]],
        *,
        compression: type[Compressor],
        passes: int,
        average: bool,
        predivide: float,
        scope: Scope | None = None,
        sparse_as_dense: bool = False,
        process_set: object = None,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.buckets = [list(b) for b in buckets]
        self.compression = compression
        self.passes_per_step = passes
        self.average = average
        self.prescale = 1.0 / predivide
        self.postscale = predivide
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        """Where sparse gradients are gathered (``None``: every process)."""
        self.debug = debug_requested(None)
        self.scope = scope if scope is not None else resolve(None, "DistributedOptimizer")
        """The process set gradients are averaged over; a rank outside it keeps its own."""
        self.slot = -1
        """This optimizer's number among the whole job's (:func:`manygpu.horovod.joining.
        register`); its steps announce it, for ranks in ``hvd.join()``. -1: not announced."""
        self._bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self._hooks: list[Any] = []
        self.reset()

    # -- state ------------------------------------------------------------------
    def reset(self) -> None:
        """Forget passes counted and reductions started (after a step, or a state load)."""
        self._passes = [0] * len(self.params)
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._pending: dict[int, tuple[dist.Work | None, torch.Tensor, Any, Pending]] = {}
        self._beacons: list[StepBeacon] = []
        self.dirty = False

    def register_hooks(self) -> None:
        """One hook per parameter, run when its gradient is accumulated."""
        for i, p in enumerate(self.params):
            self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(i)))

    def _hook(self, index: int) -> Any:
        def hook(_: torch.Tensor) -> None:
            self.on_grad(index)

        return hook

    def on_grad(self, index: int) -> None:
        """A gradient was accumulated: count the pass; launch what became ready."""
        count = self._passes[index] + 1
        if count > self.passes_per_step:
            raise UsageError(
                f"gradients of {self.names[index]!r} were computed more than "
                f"backward_passes_per_step={self.passes_per_step} times before step(); "
                "raise backward_passes_per_step to accumulate gradients locally"
            )
        self._passes[index] = count
        self.dirty = True
        if count == self.passes_per_step:
            bucket = self._bucket_of[index]
            self._ready[bucket] += 1
            while self._next < len(self.buckets) and self._ready[self._next] == len(
                self.buckets[self._next]
            ):
                self._launch(self._next)
                self._next += 1

    # -- communication ------------------------------------------------------------
    def describe(self, bucket: int) -> str:
        members = self.buckets[bucket]
        shown = ", ".join(self.names[i] for i in members[:3])
        more = f" and {len(members) - 3} more" if len(members) > 3 else ""
        return (
            f"DistributedOptimizer gradient bucket {bucket + 1}/{len(self.buckets)} ({shown}{more})"
        )

    def _flatten(self, bucket: int) -> torch.Tensor:
        """The bucket's gradients (zeros where missing), then two flags each: has a
        gradient, has a sparse one (sent gathered afterwards unless sparse_as_dense)."""
        members = [self.params[i] for i in self.buckets[bucket]]
        parts, flags, sparse_marks = [], [], []
        for p in members:
            g = p.grad
            flags.append(g is not None)
            sparse_marks.append(g is not None and g.is_sparse)
            if g is None or (sparse_marks[-1] and not self.sparse_as_dense):
                parts.append(p.new_zeros(p.numel()))
            else:
                parts.append((g.to_dense() if g.is_sparse else g).reshape(-1))
        marks = torch.tensor(flags + sparse_marks, dtype=members[0].dtype, device=members[0].device)
        parts.append(marks)
        return torch.cat(parts)

    def _launch(self, bucket: int) -> None:
        if self.slot >= 0:  # before each bucket: a joined rank reads it, and stands in
            self._beacons.append(StepBeacon(self.slot, bucket))
        flat = self._flatten(bucket)
        if self.prescale != 1.0:
            flat.mul_(self.prescale)
        sent, ctx = self.compression.compress(flat)
        desc = self.describe(bucket)
        seq = next_call(self.scope)
        if self.debug and self.scope.whole:
            # The site is the bucket, not a line: a bucket may be launched from a hook
            # on one rank and from step() on another (a gradient only some ranks have).
            dbg.check_same_call(
                "all_reduce",
                sent,
                timeout_s=session().timeout_s,
                extra=bucket,
                site=f"in DistributedOptimizer bucket {bucket}",
            )
        work = dist.all_reduce(sent, op=dist.ReduceOp.SUM, group=self.scope.group, async_op=True)
        record = Pending(
            works=[work], finish=lambda: None, description=desc, seq=seq, scope=self.scope
        )
        self._pending[bucket] = (work, sent, ctx, record)

    def synchronize(self) -> None:
        """Launch the rest, wait for every bucket and write the results into ``.grad``."""
        if not active() or self.scope.rank < 0:  # outside the set: local gradients, as Horovod
            self.reset()
            return
        for bucket in range(self._next, len(self.buckets)):
            self._launch(bucket)
        self._next = len(self.buckets)
        world = self.scope.size
        for bucket, beacon in enumerate(self._beacons):
            beacon.finish(f"{self.describe(bucket)}: announcement", session().timeout_s)
        gathered: list[int] = []
        for bucket in sorted(self._pending):
            _, sent, ctx, record = self._pending[bucket]
            wait_pending(record)
            flat = self.compression.decompress(sent, ctx)
            factor = self.postscale / world if self.average else self.postscale
            if factor != 1.0:
                flat.mul_(factor)
            gathered += self._unpack(bucket, flat)
        self._gather_sparse(gathered)
        self.reset()

    def _unpack(self, bucket: int, flat: torch.Tensor) -> list[int]:
        """Write the bucket's results into ``.grad``; the members left to the sparse path."""
        members = self.buckets[bucket]
        n_members = len(members)
        values, marks = flat[: -2 * n_members], flat[-2 * n_members :].tolist()
        flags, sparse_marks = marks[:n_members], marks[n_members:]
        gathered, offset = [], 0
        with torch.no_grad():
            for i, flag, is_sparse in zip(members, flags, sparse_marks, strict=True):
                p = self.params[i]
                n = p.numel()
                if is_sparse != 0 and not self.sparse_as_dense:
                    gathered.append(i)
                elif flag != 0:  # some rank had a gradient: everyone takes the result
                    new = values[offset : offset + n].view_as(p)
                    if is_sparse != 0:  # back to sparse for the optimizer, as Horovod
                        p.grad = new.to_sparse()
                    elif p.grad is None or p.grad.is_sparse or p.grad.shape != p.shape:
                        p.grad = new.clone()
                    else:
                        p.grad.copy_(new)
                offset += n
        return gathered

    def _gather_sparse(self, indices: list[int]) -> None:
        """Sparse gradients (some rank had one): every rank's entries, kept sparse.

        Started only after the buckets' flags said which parameters need it, so
        every rank starts the same gathers in the same order.
        """
        started = []
        for i in indices:
            p, g = self.params[i], self.params[i].grad
            local = None if g is None else g if g.is_sparse else g.to_sparse(1)
            handle = sparse.start(
                local, p, self.names[i], average=self.average, process_set=self.process_set
            )
            started.append((p, handle))
        for p, handle in started:
            p.grad = handle()
