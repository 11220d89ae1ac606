"""The communication sweep: nccl-tests' conventions over manygpu.comm and our algorithms.

Run on every rank of a job (``manygpu bench comm`` launches it). For each
message size (doubling) and each operation / algorithm: warm-up, then timed
iterations, each timed on every rank and taken as the slowest rank's time;
the median is reported with algbw = bytes / time and busbw = algbw * factor,
the factor making busbw comparable to the link speed (nccl-tests' PERFORMANCE.md).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from manygpu import comm
from manygpu.comm.algorithms import ALGORITHMS
from manygpu.comm.common import scratch_device
from manygpu.errors import UsageError

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all")
ALGOS = ("native", *ALGORITHMS)


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for ``op`` over ``n`` ranks (nccl-tests' definitions)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """What to measure."""

    ops: tuple[str, ...] = ("all_reduce",)
    """Collectives to sweep, from :data:`OPS`."""
    algorithms: tuple[str, ...] = ALGOS
    """All-reduce implementations; other ops use the backend's only."""
    min_bytes: int = 8
    """Smallest message; sizes double from here."""
    max_bytes: int = 64 << 20
    """Largest message."""
    dtype: str = "float32"
    """Element type, a ``torch`` dtype's name."""
    iters: int = 0
    """Timed iterations per size; 0 adapts to the size (more for small messages)."""
    warmup: int = 2
    """Untimed iterations per size first (connections, allocator)."""
    timeout_s: float = 120.0
    """How long one collective may take before it fails, naming the rank."""

    def __post_init__(self) -> None:
        bad = [op for op in self.ops if op not in OPS]
        if bad:
            raise UsageError(f"unknown op {bad[0]!r}; choose from {', '.join(OPS)}")
        bad = [a for a in self.algorithms if a not in ALGOS]
        if bad:
            raise UsageError(f"unknown algorithm {bad[0]!r}; choose from {', '.join(ALGOS)}")
        if not 1 <= self.min_bytes <= self.max_bytes:
            raise UsageError(
                f"need 1 <= min bytes <= max bytes, got {self.min_bytes}, {self.max_bytes}"
            )
        if self.dtype not in ("float32", "float64", "float16", "bfloat16", "int32", "int64"):
            raise UsageError(f"unsupported dtype {self.dtype!r}")
        if self.iters < 0 or self.warmup < 0:
            raise UsageError(f"iterations must be 0 or more, got {self.iters} and {self.warmup}")
        if not 0 < self.timeout_s < float("inf"):
            raise UsageError(f"timeout must be a number of seconds > 0, got {self.timeout_s}")

    def sizes(self) -> list[int]:
        out, size = [], self.min_bytes
        while size <= self.max_bytes:
            out.append(size)
            size *= 2
        return out

    def iterations(self, nbytes: int) -> int:
        if self.iters:
            return self.iters
        return 20 if nbytes < (1 << 20) else 10 if nbytes < (32 << 20) else 3


@dataclass(frozen=True, kw_only=True)
class CommBenchConfig:
    """What ``manygpu bench comm`` asks of every rank: the sweep and where results go."""

    sweep: SweepConfig = field(default_factory=SweepConfig)
    """What to measure."""
    json_path: str = ""
    """Rank 0 writes the rows, fits and machine here (empty: no file)."""
    plot: str = ""
    """Also a busbw-vs-size PNG here (empty: none)."""
    markdown: str = ""
    """Also the table in markdown here (empty: none)."""
    label: str = ""
    """A name for this run in the table's title and the JSON."""
    command: str = ""
    """The command line that asked for the run, recorded in the JSON."""


@dataclass(frozen=True, kw_only=True)
class CommRow:
    """One line of the table."""

    op: str
    algorithm: str
    bytes: int
    count: int
    dtype: str
    ranks: int
    time_us: float
    algbw_gbs: float
    busbw_gbs: float
    wrong: int
    """Elements that differ from the expected result (0 = correct)."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


Runner = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def _case(op: str, algorithm: str, count: int, dtype: torch.dtype, timeout_s: float) -> Runner:
    """A closure that runs ``op`` once and returns (result, expected)."""
    n, r = dist.get_world_size(), dist.get_rank()
    dev = scratch_device()  # NCCL needs CUDA tensors, gloo CPU ones
    total = float(n * (n + 1) // 2)
    if op == "all_reduce":
        fn = ALGORITHMS.get(algorithm)
        buf = torch.empty(count, dtype=dtype, device=dev)

        def run_all_reduce() -> tuple[torch.Tensor, torch.Tensor]:
            buf.fill_(r + 1)
            out = fn(buf, timeout_s=timeout_s) if fn else comm.all_reduce(buf, timeout_s=timeout_s)
            return out, torch.full_like(out, total)

        return run_all_reduce
    part = count // n
    if op == "all_gather":
        local = torch.full((part,), float(r + 1), dtype=dtype, device=dev)
        expected = torch.arange(1, n + 1, dtype=dtype, device=dev).repeat_interleave(part)
        return lambda: (comm.all_gather(local, timeout_s=timeout_s), expected)
    if op == "reduce_scatter":
        full = torch.full((part * n,), float(r + 1), dtype=dtype, device=dev)
        return lambda: (
            comm.reduce_scatter(full, timeout_s=timeout_s),
            torch.full((part,), total, dtype=dtype, device=dev),
        )
    if op == "broadcast":
        buf = torch.empty(count, dtype=dtype, device=dev)

        def run_broadcast() -> tuple[torch.Tensor, torch.Tensor]:
            buf.fill_(7 if r == 0 else 0)
            return comm.broadcast(buf, 0, timeout_s=timeout_s), torch.full_like(buf, 7)

        return run_broadcast
    if op == "reduce":
        buf = torch.empty(count, dtype=dtype, device=dev)

        def run_reduce() -> tuple[torch.Tensor, torch.Tensor]:
            buf.fill_(r + 1)
            out = comm.reduce(buf, 0, timeout_s=timeout_s)
            return (out, torch.full_like(out, total)) if r == 0 else (out, out)

        return run_reduce
    # all_to_all: chunk j of rank r holds r*n + j; rank r receives i*n + r from rank i.
    send = torch.arange(n, dtype=dtype, device=dev).repeat_interleave(part) + r * n
    expected = (torch.arange(n, dtype=dtype, device=dev) * n + r).repeat_interleave(part)
    return lambda: (comm.all_to_all(send, timeout_s=timeout_s), expected)


def _measure(run: Runner, iters: int, warmup: int, timeout_s: float) -> tuple[float, int]:
    """(median over iterations of the slowest rank's seconds, wrong elements)."""
    for _ in range(warmup):
        run()
    times = torch.zeros(iters, dtype=torch.float64)
    wrong = 0
    for i in range(iters):
        comm.barrier(timeout_s=timeout_s)
        start = time.perf_counter()
        out, expected = run()
        if out.is_cuda:  # NCCL returns once the work is queued; time its completion
            torch.cuda.synchronize()
        times[i] = time.perf_counter() - start
        wrong = max(wrong, int((out != expected).sum()))
    dev = scratch_device()
    times = comm.all_reduce(times.to(dev), "max", timeout_s=timeout_s)
    stats = comm.all_reduce(torch.tensor([wrong], device=dev), "max", timeout_s=timeout_s)
    return statistics.median(times.cpu().tolist()), int(stats.item())


def sweep(cfg: SweepConfig, progress: Callable[[CommRow], None] | None = None) -> list[CommRow]:
    """Measure every (op, algorithm, size); every rank returns the same rows."""
    n = dist.get_world_size() if dist.is_initialized() else 1
    dtype = getattr(torch, cfg.dtype)
    elem = torch.empty(0, dtype=dtype).element_size()
    rows: list[CommRow] = []
    for op in cfg.ops:
        for algorithm in cfg.algorithms if op == "all_reduce" else ("native",):
            for nbytes in cfg.sizes():
                count = max(n, nbytes // elem // n * n)
                run = _case(op, algorithm, count, dtype, cfg.timeout_s)
                seconds, wrong = _measure(run, cfg.iterations(nbytes), cfg.warmup, cfg.timeout_s)
                size = count * elem
                algbw = size / seconds / 1e9
                row = CommRow(
                    op=op,
                    algorithm=algorithm,
                    bytes=size,
                    count=count,
                    dtype=cfg.dtype,
                    ranks=n,
                    time_us=seconds * 1e6,
                    algbw_gbs=algbw,
                    busbw_gbs=algbw * bus_factor(op, n),
                    wrong=wrong,
                )
                rows.append(row)
                if progress is not None:
                    progress(row)
    return rows


MEMCPY_MAX = 256 << 20
"""The largest local copy the probe makes (a sweep beyond it is not slowed further)."""


def memcpy_bytes(max_bytes: int) -> int:
    """The probe's size: the sweep's largest message (its ceiling at that size), at least
    4 KiB (a copy too small to time) and at most :data:`MEMCPY_MAX`."""
    return min(max(max_bytes, 4 << 10), MEMCPY_MAX)


def memcpy_gbs(nbytes: int = MEMCPY_MAX, repeats: int = 5) -> float:
    """A local copy's bandwidth: the ceiling for loopback transfers of ``nbytes``."""
    src = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9
