"""``DistributedOptimizer``: the user's optimizer, with gradients averaged over ranks.

As in Horovod, the result is an instance of a class made on the fly that
derives from the user's optimizer class (so ``isinstance(opt, torch.optim.SGD)``
still holds and learning-rate schedulers work), with ``step()`` waiting for
the gradients' all-reduce first. Unlike Horovod, the user's optimizer object
is not rebuilt through its constructor: its attributes (state, groups, hooks)
are carried over as they are, so optimizers whose constructors need
arguments, and state already accumulated, survive the wrapping.

The all-reduce itself (hooks, buckets, overlap with backward) is
:class:`~manygpu.horovod.grad_sync.GradientSync`.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from manygpu.comm.common import active
from manygpu.errors import UsageError
from manygpu.horovod.basics import session
from manygpu.horovod.buckets import DEFAULT_CAP_MB, MIB, plan_buckets, split_even
from manygpu.horovod.checks import agree
from manygpu.horovod.compression import Compression, Compressor
from manygpu.horovod.grad_sync import GradientSync
from manygpu.horovod.joining import register
from manygpu.horovod.process_sets import global_process_set, resolve
from manygpu.horovod.reduce_ops import ReduceOp, resolve_op

_STEP_AFTER_SYNC = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code."
)


class _DistributedOptimizer(torch.optim.Optimizer):
    """Placed before the user's optimizer class in the class made by DistributedOptimizer."""

    _hvd: GradientSync
    _hvd_should_sync: bool
    _hvd_synchronized: bool

    @property
    def backward_passes_per_step(self) -> int:
        return self._hvd.passes_per_step

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated before each step."""
        self._hvd.passes_per_step = _passes(passes)
        self._hvd.reset()

    def synchronize(self) -> None:
        """Wait for every gradient's all-reduce; ``.grad`` then holds the averages.

        For gradient clipping: ``synchronize()``, clip, then ``step()`` inside
        ``skip_synchronize()``.
        """
        self._hvd.synchronize()
        self._hvd_synchronized = True

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Make ``step()`` skip the synchronization (already done by ``synchronize()``)."""
        self._hvd_should_sync = False
        try:
            yield
        finally:
            self._hvd_should_sync = True

    def step(self, closure: Any = None) -> Any:
        """Wait for the gradients (unless skipped), then the user's optimizer's step."""
        if self._hvd_should_sync:
            if self._hvd_synchronized:
                warnings.warn(_STEP_AFTER_SYNC, stacklevel=2)
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The user's ``zero_grad``, refused between ``backward()`` and ``step()``."""
        if self._hvd.dirty:
            raise UsageError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(): the gradients are still being "
                "all-reduced (with backward_passes_per_step > 1, call zero_grad only after step)"
            )
        super().zero_grad(set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's state; pending reductions are forgotten (as Horovod)."""
        self._hvd.reset()
        self._hvd_synchronized = False
        self._hvd_should_sync = True
        super().load_state_dict(state_dict)


def _passes(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"backward_passes_per_step must be an integer >= 1, got {value!r}")
    return value


def parameter_names(
    optimizer: torch.optim.Optimizer, named_parameters: Iterable[Any] | None
) -> dict[int, str]:
    """``id(param) -> name`` with Horovod's checks (tuples, unique, every parameter named)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return {id(p): f"allreduce.noname.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise UsageError(
            "named_parameters should be a sequence of tuples (name, parameter), usually "
            "produced by model.named_parameters()"
        )
    counts = Counter(str(n) for n, _ in named)
    dups = sorted(n for n, c in counts.items() if c > 1)
    if dups:
        raise UsageError(f"parameter names in named_parameters must be unique; duplicates: {dups}")
    names = {id(p): str(n) for n, p in named}
    unnamed = [tuple(p.shape) for p in params if id(p) not in names]
    if unnamed:
        raise UsageError(
            f"named_parameters was given, but {len(unnamed)} of the optimizer's parameters "
            f"are not in it (shapes {unnamed[:3]}); pass model.named_parameters() of the "
            "model whose parameters the optimizer holds"
        )
    return names


def _buckets(
    params: list[torch.Tensor], groups: Any, num_groups: int, cap_mb: float
) -> list[list[int]]:
    """Buckets over ``params`` (already in reverse order): explicit groups, a count, or size."""
    keys = [(p.device, p.dtype) for p in params]
    if groups is not None and not isinstance(groups, int):
        where = {id(p): i for i, p in enumerate(params)}
        chosen = [[where[id(p)] for p in group if id(p) in where] for group in groups]
        listed = {i for group in chosen for i in group}
        chosen += [[i] for i in range(len(params)) if i not in listed]  # Horovod: one each
        # In the order gradients arrive (a bucket waits for those before it).
        parts = sorted((sorted(group) for group in chosen if group), key=lambda g: g[0])
    elif num_groups or isinstance(groups, int):
        parts = split_even(len(params), int(groups if isinstance(groups, int) else num_groups))
    else:
        nbytes = [p.numel() * p.element_size() for p in params]
        return plan_buckets(nbytes, keys, cap_bytes=int(cap_mb * MIB))
    # A bucket is one flat tensor: split groups that mix devices or dtypes.
    out = []
    for part in parts:
        same = plan_buckets([0] * len(part), [keys[i] for i in part], cap_bytes=1 << 62)
        out += [[part[i] for i in sub] for sub in same]
    return out


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[Any] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: object = ReduceOp.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: object = global_process_set,
    *,
    bucket_cap_mb: float = DEFAULT_CAP_MB,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so gradients are all-reduced as backward produces them.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        named_parameters: ``model.named_parameters()``, to name gradients in errors.
        compression: ``Compression.none`` or ``Compression.fp16`` (halves the bytes sent).
        backward_passes_per_step: backward passes accumulated locally before each
            ``step()``; the all-reduce starts after the last one.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: with Average, divide by this before the sum and
            by ``size / factor`` after it (for low-precision ranges).
        num_groups, groups: Horovod's explicit grouping; they choose the buckets.
        sparse_as_dense: send sparse gradients densely in the buckets (then sparse
            again for the optimizer); by default their indices and values are
            all-gathered and the gradient stays sparse (:mod:`manygpu.horovod.sparse`).
        process_set: average over this set's ranks only; on a rank outside it the
            optimizer steps with its own gradients (as Horovod).
        bucket_cap_mb: (manygpu) bucket size in MiB when no groups are given; the
            default is the ``ddp`` strategy's (see :mod:`manygpu.horovod.buckets`).
    """
    session()  # refuses before hvd.init(), as Horovod
    scope = resolve(process_set, "DistributedOptimizer", member=False)
    if isinstance(optimizer, _DistributedOptimizer):
        raise UsageError("this optimizer is already a DistributedOptimizer; wrap it once")
    rop = resolve_op(op, None)
    if rop not in (ReduceOp.Average, ReduceOp.Sum):
        raise UsageError(f"DistributedOptimizer: op must be hvd.Average or hvd.Sum, not {rop.name}")
    if gradient_predivide_factor != 1.0 and rop is not ReduceOp.Average:
        raise UsageError("gradient_predivide_factor needs op=hvd.Average")
    if not gradient_predivide_factor > 0:
        raise UsageError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    if not bucket_cap_mb > 0:
        raise UsageError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
    names = parameter_names(optimizer, named_parameters)
    # Reverse order: gradients appear roughly from the last layer to the first.
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad][::-1]
    buckets = _buckets(params, groups, num_groups, bucket_cap_mb)
    sync = GradientSync(
        params, [names[id(p)] for p in params], buckets,
        compression=compression, passes=_passes(backward_passes_per_step),
        average=rop is ReduceOp.Average, predivide=gradient_predivide_factor, scope=scope,
        sparse_as_dense=bool(sparse_as_dense), process_set=process_set,
    )  # fmt: skip
    if scope.rank >= 0:
        _agree_on_layout(sync)
    cls = type(type(optimizer).__name__, (_DistributedOptimizer, type(optimizer)), {})
    wrapped: Any = object.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._hvd, wrapped._hvd_should_sync, wrapped._hvd_synchronized = sync, True, False
    # Horovod's own attribute (parameter -> name), which scripts and its tests read.
    every = [p for g in optimizer.param_groups for p in g["params"]]
    wrapped._parameter_names = {p: names[id(p)] for p in every}
    if active() and scope.rank >= 0:
        sync.register_hooks()
        if scope.whole:  # ranks in hvd.join() stand in for its steps
            sync.slot = register(sync)
    return wrapped


def _agree_on_layout(sync: GradientSync) -> None:
    """Every rank must hold the same parameters in the same buckets (checked once, here)."""
    layout = [
        (n, tuple(p.shape), str(p.dtype)) for n, p in zip(sync.names, sync.params, strict=True)
    ]
    desc = f"DistributedOptimizer({len(layout)} parameters in {len(sync.buckets)} buckets)"
    agree(
        "all_reduce", None, key=("DistributedOptimizer", layout, sync.buckets), desc=desc,
        details=layout, scope=sync.scope,
    )  # fmt: skip
