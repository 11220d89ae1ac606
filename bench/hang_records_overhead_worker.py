"""One rank of one job of ``bench/hang_records_overhead.py``: time small collectives and DDP steps.

The driver starts two of these per job, one variant's switches in their
environment (``TORCH_FR_BUFFER_SIZE``; ``MANYGPU_EVIDENCE_DIR`` when the variant
has the watcher). The recorder reads its buffer size when the process starts,
so every job is two fresh processes. Each rank times:

- ``all_reduce 2 ranks``: microseconds per ``all_reduce`` of 4 float32 over
  both ranks (blocks of ``iters`` calls, a barrier before each block);
- ``all_reduce 1 rank``: the same call on a group of one rank (each rank its
  own, timed one rank at a time): no peer to wait for, so the recorder's own
  per-call cost is not lost in loopback latency of a millisecond or more;
- ``DDP step``: seconds per training step of the demo (``manygpu demo``'s
  SimpleCNN on 16x16 digits, Adam, 32 samples per rank = its global batch of
  64 on 2 workers) through ``Parallel(strategy="ddp")``, in blocks of
  ``steps`` steps;
- ``counter read``: microseconds of one watcher poll (``evidence.fr_status``),
  which the watcher pays twice a second.

Every block's wall and process-CPU time per call goes back, with what the
rank saw of the recorder and the watcher (proof of the variant): rank 0
writes all ranks' records, as one JSON list, to ``--out``.

Started by the driver with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``
set (no launcher)::

    python bench/hang_records_overhead_worker.py --config '{...}' --out /tmp/job.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """How often a rank times each measurement (the driver's ``Config`` minus its own fields)."""

    iters: int
    """``all_reduce`` calls per timed block over 2 ranks."""
    solo_iters: int
    """``all_reduce`` calls per timed block on a 1-rank group."""
    steps: int
    """DDP steps per timed block."""
    blocks: int
    """Timed blocks of each measurement."""
    warmup: int
    """Untimed DDP steps (and ``iters`` untimed calls) before the blocks."""

    @classmethod
    def pick(cls, values: Any) -> WorkerConfig:
        """The worker's fields of ``values`` (an object with these attributes)."""
        return cls(**{f.name: getattr(values, f.name) for f in fields(cls)})


def _timed_blocks(
    fn: Callable[[], None], count: int, blocks: int, sync: Callable[[], None]
) -> list[float]:
    """Seconds per call of ``fn``, one value per block of ``count`` calls."""
    return [wall for wall, _ in _timed_blocks_cpu(fn, count, blocks, sync)]


def _timed_blocks_cpu(
    fn: Callable[[], None], count: int, blocks: int, sync: Callable[[], None]
) -> list[tuple[float, float]]:
    """(wall, process CPU) seconds per call of ``fn``, one pair per block of ``count`` calls.

    The CPU time is every thread of this process (gloo's worker and the
    watcher included): what the call costs, without the waits that make its
    wall time swing with the machine's load.
    """
    out = []
    for _ in range(blocks):
        sync()  # both ranks start a block together
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(count):
            fn()
        out.append(((time.perf_counter() - start) / count, (time.process_time() - cpu) / count))
    return out


def _nothing() -> None:
    pass


def _ddp_step(image_size: int, batch: int, seed: int) -> tuple[Callable[[], None], Any]:
    """The demo's training step through ``Parallel(strategy="ddp")``; (step, Parallel)."""
    import torch
    import torch.nn.functional as F

    from manygpu import Parallel
    from manygpu.demo.data import digits
    from manygpu.demo.model import SimpleCNN

    par = Parallel(strategy="ddp", precision="fp32")  # as manygpu demo
    torch.manual_seed(0)
    model = SimpleCNN(image_size)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)  # the demo's optimizer and rate
    model, opt = par.prepare(model, opt)
    images, labels = digits(image_size)[0].tensors
    gen = torch.Generator().manual_seed(seed)
    # Batches drawn up front: the loader is not what is measured.
    batches = [
        (images[i], labels[i])
        for i in (torch.randint(len(labels), (batch,), generator=gen) for _ in range(64))
    ]
    count = [0]

    def step() -> None:
        x, y = batches[count[0] % len(batches)]
        count[0] += 1
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        par.backward(loss)
        opt.step()

    return step, par


def _collectives_per_step(step: Callable[[], None], steps: int) -> float | None:
    """Collectives a DDP step issues, from the recorder's counters (``None`` with it off)."""
    from manygpu.launch import evidence

    def enqueued() -> int | None:
        status = evidence.fr_status()
        if not status:
            return None
        return sum(int(c.get("last_enqueued_collective", 0)) for c in status.values())

    before = enqueued()
    for _ in range(steps):
        step()
    after = enqueued()
    return None if before is None or after is None else (after - before) / steps


def _recorder_facts(watcher: Any) -> dict[str, Any]:
    """What this rank's Flight Recorder holds and whether its watcher runs: proof of the variant."""
    from manygpu.launch import evidence

    entries = evidence.fr_records().get("entries", [])
    polls = []
    for _ in range(200):
        start = time.perf_counter()
        evidence.fr_status()
        polls.append(time.perf_counter() - start)
    return {
        "fr_buffer_size": os.environ.get("TORCH_FR_BUFFER_SIZE"),
        "fr_entries": len(entries),
        "fr_last_op": entries[-1].get("profiling_name") if entries else None,
        "watcher_alive": bool(watcher is not None and watcher.is_alive()),
        "poll_us": statistics.median(polls) * 1e6,
    }


def _time_small_calls(cfg: WorkerConfig, rank: int, world: int) -> dict[str, list[float]]:
    """Microseconds per ``all_reduce`` of 4 float32, per block: over both ranks, and alone."""
    import torch
    import torch.distributed as dist

    tensor = torch.ones(4)

    def call() -> None:
        dist.all_reduce(tensor)

    _timed_blocks(call, cfg.iters, 1, dist.barrier)  # warm-up
    duo = _timed_blocks_cpu(call, cfg.iters, cfg.blocks, dist.barrier)
    solo_group, _ = dist.new_subgroups(group_size=1)  # every rank its own group

    def solo_call() -> None:
        dist.all_reduce(tensor, group=solo_group)

    # One rank at a time (the other waits in a barrier, off the CPU), so the
    # two ranks' loops do not compete for the 2 cores.
    solo: list[tuple[float, float]] = []
    for turn in range(world):
        if turn == rank:
            _timed_blocks(solo_call, cfg.solo_iters, 1, _nothing)
            solo = _timed_blocks_cpu(solo_call, cfg.solo_iters, cfg.blocks, _nothing)
        dist.barrier()
    return {
        "allreduce_us": [w * 1e6 for w, _ in duo],
        "allreduce_cpu_us": [c * 1e6 for _, c in duo],
        "solo_us": [w * 1e6 for w, _ in solo],
        "solo_cpu_us": [c * 1e6 for _, c in solo],
    }


def worker_main(cfg: WorkerConfig, out: Path) -> None:
    """One rank: start the watcher if this variant has it, then time everything."""
    import torch.distributed as dist

    from manygpu.launch import evidence

    # Before the process group, as manygpu's launched worker does it (launch/worker.py).
    watcher = evidence.start(os.environ)
    step, par = _ddp_step(image_size=16, batch=32, seed=int(os.environ["RANK"]))
    with par:
        blocks = _time_small_calls(cfg, par.rank, par.world_size)
        _timed_blocks(step, cfg.warmup, 1, dist.barrier)
        per_step = _collectives_per_step(step, cfg.warmup)
        step_s = _timed_blocks(step, cfg.steps, cfg.blocks, dist.barrier)
        blocks["step_ms"] = [s * 1e3 for s in step_s]
        mine = {"rank": par.rank, "blocks": blocks, "collectives_per_step": per_step}
        mine.update(_recorder_facts(watcher))
        everyone: list[Any] = [None] * par.world_size
        dist.all_gather_object(everyone, mine)
        if par.rank == 0:
            out.write_text(json.dumps(everyone))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="WorkerConfig as JSON")
    p.add_argument("--out", type=Path, required=True, help="JSON file rank 0 writes")
    ns = p.parse_args(argv)
    worker_main(WorkerConfig(**json.loads(ns.config)), ns.out)


if __name__ == "__main__":
    main()
