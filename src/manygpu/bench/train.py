"""Training throughput on one job, split into compute, exposed communication and data wait.

Run on every rank (``manygpu bench train`` launches it once per worker count).
Method, per rank:

* warm-up steps (not timed), then timed steps in blocks that alternate between
  normal steps (gradients synchronised) and the *same* steps with gradient
  synchronisation switched off (DDP's ``no_sync``); ranks meet at a barrier,
  outside the timing, between blocks so no block starts with one rank behind;
* **data wait** = time inside ``next(loader)`` (collation and the copy to the device);
* **compute** = a no-sync step minus its data wait: forward, backward and the
  optimizer with every rank still competing for the same CPUs / links as in a
  normal step, but no gradient all-reduce; capped at the normal step minus its
  data wait, because it is measured on other steps and must not exceed the
  step it is part of (:func:`split_step`; the raw value is kept in the JSON);
* **exposed communication** = normal step - compute - data wait: the part of the
  all-reduce that backward did not hide. Compute, exposed communication and data
  wait add up to the normal step;
* **throughput** = global samples of the normal steps / the slowest rank's time
  spent in them.

With one worker there is nothing to synchronise: every timed step is normal and
communication is zero. For sharded strategies (zero1, fsdp) parameter gathers
are not switched off with gradient sync, so they count as compute.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from manygpu.bench.models import SIZES, Workload
from manygpu.bench.train_log import StepLog
from manygpu.core.parallel import Parallel
from manygpu.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class TrainBenchConfig:
    """What each job of the benchmark runs."""

    model: str = "resnet"
    """A built-in workload name or ``module:function``."""
    size: str = "auto"
    """Built-in workloads' size: ``small``, ``full`` (GPT-2 small, ResNet-50 at 224x224)
    or ``auto`` (full on a GPU, small on the CPU)."""
    batch: int | None = None
    """Samples per worker per step (weak scaling: the global batch grows with workers);
    ``None``: the workload's own (16 for GPT-2 small, 128 for ResNet-50, else 32)."""
    steps: int = 20
    """Timed normal steps (and as many no-sync steps with more than one worker)."""
    warmup: int = 5
    """Untimed steps first (allocator, kernels, DDP's bucket rebuild, compilation)."""
    block: int = 5
    """Steps per block; normal and no-sync blocks alternate so drifts hit both alike."""
    precision: str | None = None
    """A precision :class:`~manygpu.Parallel` accepts; ``None``: its default."""
    compile: bool = False
    """Pass ``compile=True`` to :class:`~manygpu.Parallel` (``torch.compile`` per strategy)."""
    strategy: str | None = None
    """``None``: ``ddp`` with several workers, ``single`` with one."""
    peak_tflops: float | None = None
    """Peak TFLOP/s per worker for MFU; ``None`` looks the GPU up (CPUs: no MFU)."""
    log_with: tuple[str, ...] = ()
    """Trackers every timed normal step is logged to (``Parallel(log_with=...)``)."""
    run_dir: str | None = None
    """Where the trackers write, each job a run of its own; ``None``: ``runs``."""

    def __post_init__(self) -> None:
        from manygpu.core.config import PRECISIONS
        from manygpu.tracking.registry import check_names

        check_names(self.log_with)

        for name in ("steps", "block"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"{name} must be an integer >= 1, got {value!r}")
        if self.batch is not None and (not isinstance(self.batch, int) or self.batch < 1):
            raise UsageError(f"batch must be an integer >= 1, got {self.batch!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise UsageError(f"warmup must be an integer >= 0, got {self.warmup!r}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise UsageError(f"peak TFLOP/s must be > 0, got {self.peak_tflops}")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise UsageError(
                f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}"
            )
        if self.size not in SIZES:
            raise UsageError(f"unknown size {self.size!r}; choose one of {', '.join(SIZES)}")


def parallel_options(cfg: TrainBenchConfig, accepted: Collection[str]) -> dict[str, Any]:
    """The keyword arguments of the job's :class:`~manygpu.Parallel`.

    Only what the user chose is passed, so ``Parallel``'s own defaults are what
    gets measured otherwise. ``accepted`` is the names ``ParallelConfig`` has
    (:func:`parallel_fields`): asking for compilation from a manygpu without it
    is a usage error before any job starts, not a ``TypeError`` in every worker.
    """
    options: dict[str, Any] = {"strategy": cfg.strategy, "timeout_s": 600}
    if cfg.precision is not None:
        options["precision"] = cfg.precision
    if cfg.log_with:
        options.update(log_with=cfg.log_with, run_dir=cfg.run_dir)
    if cfg.compile:
        if "compile" not in accepted:
            raise UsageError(
                "--compile needs Parallel(compile=True), which this version of manygpu "
                "does not have; leave out --compile"
            )
        options["compile"] = True
    return options


def parallel_fields() -> frozenset[str]:
    """The options :class:`~manygpu.core.config.ParallelConfig` takes."""
    from manygpu.core.config import ParallelConfig

    return frozenset(f.name for f in fields(ParallelConfig))


@dataclass(frozen=True, kw_only=True)
class TrainJob:
    """One job of ``manygpu bench train``, as its command hands it to every worker."""

    bench: TrainBenchConfig = field(default_factory=TrainBenchConfig)
    """What every job of the benchmark runs."""
    threads: int = 0
    """CPU threads per worker, the same at every worker count (0: keep torch's choice)."""
    out: str
    """Rank 0 writes this job's :class:`RunStats` here as JSON."""

    def __post_init__(self) -> None:
        if not isinstance(self.threads, int) or self.threads < 0:
            raise UsageError(f"--threads must be 0 or more, got {self.threads!r}")
        if not self.out:
            raise UsageError("a bench train job needs a file for its results")


@dataclass(frozen=True, kw_only=True)
class RunStats:
    """One job's measurement (every field a rank average unless it says otherwise)."""

    model: str
    parameters: int
    strategy: str
    workers: int
    nodes: int
    device: str
    threads_per_worker: int
    precision: str
    batch_per_worker: int
    steps: int
    samples_per_s: float
    """Global throughput of the normal steps (slowest rank's time)."""
    step_s: float
    """Seconds per normal step; ``compute_s + comm_s + data_s`` add up to it."""
    compute_s: float
    """Forward, backward and optimizer: the no-sync estimate, at most ``step_s - data_s``."""
    comm_s: float
    """Exposed communication per step: step - compute - data (never below 0)."""
    data_s: float
    """Waiting for the next batch (collation and the copy to the device)."""
    flops_per_step: int
    """Forward + backward FLOPs of one worker's step (FlopCounterMode)."""
    peak_tflops: float | None
    mfu: float | None
    """Achieved / peak FLOP/s per worker; ``None`` without a known peak (CPU)."""
    nosync_compute_s: float | None = None
    """The no-sync steps' compute as measured, before capping at ``step_s - data_s``
    (``None`` with one worker); above the cap, exposed communication reads 0."""
    compiled: bool = False
    """Whether ``Parallel(compile=True)`` compiled the model."""
    tf32: bool = False
    """Whether fp32 matmuls / convolutions ran as TF32 (the MFU peak follows)."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def batches(loader: DataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The loader's batches forever (a new epoch, and shuffle, when one ends)."""
    while True:
        yield from loader


def synthetic_loader(workload: Workload, batch: int, steps_per_epoch: int) -> DataLoader:
    """A shuffled in-memory data set of ``batch * steps_per_epoch`` samples."""
    gen = torch.Generator().manual_seed(1234)
    x, y = workload.make_batch(batch * steps_per_epoch, gen)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, drop_last=True)


@dataclass
class _Timings:
    sync_step: list[float]
    sync_data: list[float]
    nosync_step: list[float]
    nosync_data: list[float]


def _run_block(
    par: Parallel,
    parts: tuple[torch.nn.Module, torch.optim.Optimizer, Workload],
    it: Iterator[tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    sync: bool,
    losses: list[torch.Tensor] | None = None,
) -> tuple[list[float], list[float]]:
    """``steps`` timed steps; returns (step seconds, data-wait seconds); appends to ``losses``."""
    model, opt, workload = parts
    cuda = par.device.type == "cuda"
    step_s, data_s = [], []
    for _ in range(steps):
        start = time.perf_counter()
        x, y = next(it)
        if cuda:  # the copy to the device is part of waiting for data
            torch.cuda.synchronize()
        got = time.perf_counter()
        # DDP decides at forward time whether the coming backward all-reduces.
        par.strategy.set_grad_sync(model, sync)
        loss = workload.loss(model(x), y)
        par.backward(loss)  # turns gradient sync back on for the next step
        if losses is not None:
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        step_s.append(time.perf_counter() - start)
        data_s.append(got - start)
    return step_s, data_s


def _timed_steps(
    par: Parallel,
    parts: tuple[torch.nn.Module, torch.optim.Optimizer, Workload],
    it: Iterator[tuple[torch.Tensor, torch.Tensor]],
    cfg: TrainBenchConfig,
    log: StepLog | None = None,
) -> _Timings:
    t = _Timings([], [], [], [])
    multi = par.world_size > 1
    while len(t.sync_step) < cfg.steps:
        n = min(cfg.block, cfg.steps - len(t.sync_step))
        par.barrier()
        losses: list[torch.Tensor] = []
        steps, data = _run_block(par, parts, it, n, sync=True, losses=losses)
        t.sync_step += steps
        t.sync_data += data
        if log is not None:  # after the block: the log's collective is not timed
            log.block(parts[1], steps, losses)
        if multi:
            par.barrier()
            steps, data = _run_block(par, parts, it, n, sync=False)
            t.nosync_step += steps
            t.nosync_data += data
    par.barrier()
    return t


@dataclass(frozen=True)
class TimedStep:
    """One step's time in parts that add up to it."""

    compute_s: float
    comm_s: float
    data_s: float


def split_step(step_s: float, data_s: float, nosync_compute_s: float | None) -> TimedStep:
    """Split a normal step into compute, exposed communication and data wait.

    Compute comes from other steps (the no-sync ones), so noise, or a no-sync
    step that is slower for its own reasons, can make it exceed what is left
    of the normal step after the data wait. It is capped there and exposed
    communication (the remainder) never goes below 0: the three parts always
    add up to the step that was timed. With one worker (``None``) the whole
    remainder is compute.
    """
    data = min(max(data_s, 0.0), step_s)
    rest = step_s - data
    compute = rest if nosync_compute_s is None else min(max(nosync_compute_s, 0.0), rest)
    return TimedStep(compute_s=compute, comm_s=rest - compute, data_s=data)


DATA_BYTES = 512 << 20
"""At most this much synthetic data per worker (ResNet-50 batches are 77 MB each)."""


def steps_per_epoch(batch_bytes: int, wanted: int, budget: int = DATA_BYTES) -> int:
    """Batches in the synthetic data set: ``wanted`` (at most 64), fewer when large."""
    return max(2, min(wanted, 64, budget // max(batch_bytes, 1)))


def _local(t: _Timings) -> list[float]:
    """This rank's [timed seconds, step, compute, comm, data, raw no-sync compute or nan]."""
    step, data = statistics.fmean(t.sync_step), statistics.fmean(t.sync_data)
    nosync = None
    if t.nosync_step:
        nosync = statistics.fmean(s - d for s, d in zip(t.nosync_step, t.nosync_data, strict=True))
    part = split_step(step, data, nosync)
    raw = float("nan") if nosync is None else nosync
    return [sum(t.sync_step), step, part.compute_s, part.comm_s, part.data_s, raw]


def resolved_precision(par: Parallel) -> str:
    """What the job's autocast really uses (``"auto"`` and the default resolve per device);
    ``"fp8"`` for float8 linears, which run inside a bf16 autocast."""
    if par.precision_choice.precision == "fp8":
        return "fp8"
    with par.autocast():
        if torch.is_autocast_enabled(par.device.type):
            dtype = torch.get_autocast_dtype(par.device.type)
            return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
    return "fp32"


def measure(par: Parallel, workload: Workload, cfg: TrainBenchConfig) -> RunStats:
    """Warm up, time, and reduce every rank's numbers into one :class:`RunStats`."""
    from manygpu.bench import mfu as mfumod

    batch = cfg.batch or workload.batch
    flops = mfumod.step_flops(workload, batch, par.device)
    model = par.prepare_model(workload.model)
    opt = par.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=1e-4))
    x, y = workload.make_batch(batch, torch.Generator().manual_seed(0))
    nbytes = x.element_size() * x.numel() + y.element_size() * y.numel()
    per_epoch = steps_per_epoch(nbytes, cfg.warmup + 2 * cfg.steps)
    loader = par.prepare_loader(synthetic_loader(workload, batch, per_epoch))
    it = batches(loader)  # type: ignore[arg-type]
    parts = (model, opt, workload)
    cuda = par.device.type == "cuda"
    device_name = torch.cuda.get_device_name(par.device) if cuda else "cpu"
    precision = resolved_precision(par)
    tf32 = cuda and mfumod.tf32_in_use(mfumod.has_convolutions(workload.model))
    peak = cfg.peak_tflops
    if peak is None and cuda:
        peak = mfumod.peak_tflops(device_name, precision, tf32)
    log = StepLog(par, global_batch=batch * par.world_size, flops=flops, peak=peak)
    _run_block(par, parts, it, cfg.warmup, sync=True)
    t = _timed_steps(par, parts, it, cfg, log)
    ranks = par.gather(torch.tensor([_local(t)], dtype=torch.float64)).reshape(-1, 6)
    elapsed = float(ranks[:, 0].max())
    step, compute, comm, data = (float(v) for v in ranks[:, 1:5].mean(0))
    raw = float(ranks[:, 5].mean())
    return RunStats(
        model=workload.name,
        parameters=workload.parameters,
        strategy=par.strategy_name,
        workers=par.world_size,
        nodes=par.world_size // max(par.cluster.local_world_size, 1),
        device=device_name,
        threads_per_worker=torch.get_num_threads(),
        precision=precision,
        batch_per_worker=batch,
        steps=cfg.steps,
        samples_per_s=batch * par.world_size * cfg.steps / elapsed,
        step_s=step,
        compute_s=compute,
        comm_s=comm,
        data_s=data,
        flops_per_step=flops,
        peak_tflops=peak,
        mfu=mfumod.mfu(flops, 1.0 / step, peak),
        nosync_compute_s=None if math.isnan(raw) else raw,
        compiled=cfg.compile,
        tf32=tf32,
    )
