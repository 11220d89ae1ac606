"""What of Horovod's PyTorch API manygpu.horovod leaves out, and the manygpu way to do it.

Touching one of these names (``hvd.elastic``, ``op=hvd.Adasum``...) raises a
:class:`NotSupportedError` that names the missing piece and what to use
instead, rather than an ``AttributeError`` deep inside a script. The table is
also docs/horovod.md's list (``manygpu.horovod.missing.LEFT_OUT``).
"""

from __future__ import annotations

from typing import NoReturn

from manygpu.errors import UsageError


class NotSupportedError(UsageError, RuntimeError):
    """A part of Horovod's API that manygpu.horovod does not provide.

    Also a ``RuntimeError``: Horovod raises one for an operation its build
    lacks (``op=hvd.Adasum`` without MPI), and scripts catch that.
    """


_ELASTIC = (
    "Horovod elastic training (hvd.elastic.run, TorchState, ElasticSampler)",
    "manygpu launch --nnodes MIN:MAX --max-restarts N, with "
    "manygpu.checkpoint.Checkpointer(...).resume() to continue where the job stopped",
)
_TIMELINE = (
    "the Horovod timeline",
    "torch.profiler.profile(...) and its export_chrome_trace(); "
    "manygpu bench comm for collective timings",
)

LEFT_OUT: dict[str, tuple[str, str]] = {
    "Adasum": (
        "Adasum reduction",
        "op=hvd.Average (the default), as Parallel(strategy='ddp') and DistributedOptimizer do",
    ),
    "elastic": _ELASTIC,
    "SyncBatchNorm": (
        "hvd.SyncBatchNorm",
        "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) (CUDA), which uses the "
        "process group hvd.init() created",
    ),
    "start_timeline": _TIMELINE,
    "stop_timeline": _TIMELINE,
}
"""Name in Horovod's API -> (what it is, the manygpu way)."""


def not_supported(name: str) -> NoReturn:
    """Raise the one-line error for ``name``: what is missing and what to use."""
    what, instead = LEFT_OUT[name]
    raise NotSupportedError(
        f"hvd.{name} ({what}) is not supported by manygpu.horovod; use {instead}"
    )
