"""'This machine' as a :class:`~manygpu.plan.hardware.Cluster`, measured in a few seconds.

On a CPU machine the devices are worker processes with one share of the cores
each: compute is a one-thread matmul probe, and the link is a real gloo
all-reduce between two processes on loopback, fitted to the alpha-beta model
(with two ranks a ring all-reduce takes 2 alpha + S / B). Communication does
not overlap compute there (gloo needs the cores the model uses). With GPUs
the preset of the same device is used (its achievable rates from
:mod:`.devices`), sized to the GPUs here: measuring NVLink needs several GPUs
and a minute, which ``manygpu bench comm`` does properly.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time

import numpy as np
import torch

from manygpu.errors import UsageError
from manygpu.plan import devices
from manygpu.plan.hardware import PRESETS, Cluster
from manygpu.runtime.device import cpu_count

PROBE_SIZES = tuple(1 << s for s in range(12, 25, 2))  # 4 KB .. 16 MB


def matmul_tflops(threads: int = 1, n: int = 512, repeats: int = 5) -> float:
    """Best-of-``repeats`` fp32 matmul rate on ``threads`` CPU threads, TFLOP/s."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return 2 * n**3 / best / 1e12


def _allreduce_rank(rank: int, path: str, out: mp.Queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=rank, world_size=2)
    try:
        times = []
        for size in PROBE_SIZES:
            buf = torch.ones(size // 4)
            for _ in range(2):
                dist.all_reduce(buf)
            runs = []
            for _ in range(7):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(buf)
                runs.append(time.perf_counter() - start)
            times.append(sorted(runs)[3])  # the median: a training step meets the typical case
        if rank == 0:
            out.put(times)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def gloo_alpha_beta(timeout_s: float = 60.0) -> tuple[float, float]:
    """(alpha us per ring step, bandwidth GB/s) of a 2-process gloo all-reduce on loopback."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    fd, path = tempfile.mkstemp(prefix="manygpu-probe-")
    os.close(fd)
    os.unlink(path)  # FileStore creates it; a stale file would confuse it
    procs = [ctx.Process(target=_allreduce_rank, args=(r, path, out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        times = out.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if os.path.exists(path):
            os.unlink(path)
    x = np.array(PROBE_SIZES, dtype=float)
    y = np.array(times, dtype=float)
    beta, alpha = np.polyfit(x, y, 1, w=1.0 / y)  # relative error matters at every size
    # Two ranks: T = 2 alpha + S / B, so the fitted intercept is two ring steps.
    return max(float(alpha), 0.0) / 2 * 1e6, 1.0 / float(beta) / 1e9


def this_machine(workers: int = 2) -> Cluster:
    """This machine with ``workers`` processes (CPU) or its GPUs (closest preset)."""
    if torch.cuda.is_available():
        return gpu_cluster(torch.cuda.get_device_name(0), torch.cuda.device_count())
    import psutil

    threads = max(1, cpu_count() // workers)
    alpha_us, bw = gloo_alpha_beta()
    memory_gb = psutil.virtual_memory().total / 1e9 / workers
    rate = matmul_tflops(threads)
    return Cluster(
        name=f"this machine ({workers} CPU processes x {threads} thread(s), gloo)",
        gpus_per_node=workers,
        memory_gb=memory_gb,
        device=devices.cpu_device(rate, memory_gb),
        peak_tflops=rate,
        intra_bw_gbs=bw,
        intra_latency_us=alpha_us,
        inter_bw_gbs=bw,
        inter_latency_us=alpha_us,
        overlap=False,
    )


def gpu_cluster(gpu_name: str, count: int) -> Cluster:
    """The preset whose device is ``gpu_name`` (as CUDA names it), with ``count`` GPUs."""
    device = devices.find(gpu_name)
    preset = next((c for c in PRESETS.values() if device and c.device is device), None)
    if preset is None:
        raise UsageError(
            f"no preset for this GPU ({gpu_name}); choose --cluster "
            f"{', '.join(PRESETS)} and override its fields, e.g. --peak-tflops"
        )
    return preset.with_size(gpus_per_node=count)
