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
  normal step, but no gradient all-reduce;
* **exposed communication** = normal step - compute - data wait: the part of the
  all-reduce that backward did not hide;
* **throughput** = global samples of the normal steps / the slowest rank's time
  spent in them.

With one worker there is nothing to synchronise: every timed step is normal and
communication is zero. For sharded strategies (zero1, fsdp) parameter gathers
are not switched off with gradient sync, so they count as compute.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch
from torch.utils.data import DataLoader, TensorDataset

from manygpu.bench.models import Workload
from manygpu.core.parallel import Parallel
from manygpu.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class TrainBenchConfig:
    """What each job of the benchmark runs."""

    model: str = "resnet"
    """A built-in workload name or ``module:function``."""
    batch: int = 32
    """Samples per worker per step (weak scaling: the global batch grows with workers)."""
    steps: int = 20
    """Timed normal steps (and as many no-sync steps with more than one worker)."""
    warmup: int = 5
    """Untimed steps first (allocator, kernels, DDP's bucket rebuild)."""
    block: int = 5
    """Steps per block; normal and no-sync blocks alternate so drifts hit both alike."""
    precision: str = "fp32"
    """``fp32``, ``bf16`` or ``fp16`` (autocast, as in :class:`~manygpu.Parallel`)."""
    strategy: str | None = None
    """``None``: ``ddp`` with several workers, ``single`` with one."""
    peak_tflops: float | None = None
    """Peak TFLOP/s per worker for MFU; ``None`` looks the GPU up (CPUs: no MFU)."""

    def __post_init__(self) -> None:
        for name in ("batch", "steps", "block"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise UsageError(f"warmup must be an integer >= 0, got {self.warmup!r}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise UsageError(f"peak TFLOP/s must be > 0, got {self.peak_tflops}")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise UsageError(f"unknown precision {self.precision!r}; choose fp32, bf16 or fp16")


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
    compute_s: float
    comm_s: float
    """Exposed communication per step: step - compute - data, at least 0."""
    data_s: float
    flops_per_step: int
    """Forward + backward FLOPs of one worker's step (FlopCounterMode)."""
    peak_tflops: float | None
    mfu: float | None
    """Achieved / peak FLOP/s per worker; ``None`` without a known peak (CPU)."""

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
) -> tuple[list[float], list[float]]:
    """``steps`` timed steps; returns (step seconds, data-wait seconds)."""
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
) -> _Timings:
    t = _Timings([], [], [], [])
    multi = par.world_size > 1
    while len(t.sync_step) < cfg.steps:
        n = min(cfg.block, cfg.steps - len(t.sync_step))
        par.barrier()
        steps, data = _run_block(par, parts, it, n, sync=True)
        t.sync_step += steps
        t.sync_data += data
        if multi:
            par.barrier()
            steps, data = _run_block(par, parts, it, n, sync=False)
            t.nosync_step += steps
            t.nosync_data += data
    par.barrier()
    return t


def measure(par: Parallel, workload: Workload, cfg: TrainBenchConfig) -> RunStats:
    """Warm up, time, and reduce every rank's numbers into one :class:`RunStats`."""
    from manygpu.bench import mfu as mfumod

    flops = mfumod.step_flops(workload, cfg.batch, par.device)
    model = par.prepare_model(workload.model)
    opt = par.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=1e-4))
    per_epoch = min(cfg.warmup + 2 * cfg.steps, 64)
    loader = par.prepare_loader(synthetic_loader(workload, cfg.batch, per_epoch))
    it = batches(loader)  # type: ignore[arg-type]
    parts = (model, opt, workload)
    _run_block(par, parts, it, cfg.warmup, sync=True)
    t = _timed_steps(par, parts, it, cfg)
    step, data = statistics.fmean(t.sync_step), statistics.fmean(t.sync_data)
    if t.nosync_step:
        compute = statistics.fmean(s - d for s, d in zip(t.nosync_step, t.nosync_data, strict=True))
    else:
        compute = step - data
    local = torch.tensor([sum(t.sync_step), step, data, compute], dtype=torch.float64)
    ranks = par.gather(local.unsqueeze(0)).reshape(-1, 4)
    elapsed = float(ranks[:, 0].max())
    step, data, compute = (float(v) for v in ranks[:, 1:].mean(0))
    device_name = torch.cuda.get_device_name(par.device) if par.device.type == "cuda" else "cpu"
    peak = cfg.peak_tflops
    if peak is None and par.device.type == "cuda":
        peak = mfumod.peak_tflops(device_name, cfg.precision)
    return RunStats(
        model=workload.name,
        parameters=workload.parameters,
        strategy=par.strategy_name,
        workers=par.world_size,
        nodes=par.world_size // max(par.cluster.local_world_size, 1),
        device=device_name,
        threads_per_worker=torch.get_num_threads(),
        precision=cfg.precision,
        batch_per_worker=cfg.batch,
        steps=cfg.steps,
        samples_per_s=cfg.batch * par.world_size * cfg.steps / elapsed,
        step_s=step,
        compute_s=compute,
        comm_s=max(0.0, step - compute - data),
        data_s=data,
        flops_per_step=flops,
        peak_tflops=peak,
        mfu=mfumod.mfu(flops, 1.0 / step, peak),
    )
