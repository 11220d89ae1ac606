"""The demo's worker: run by ``manygpu demo`` once per device via ``manygpu launch``.

Trains :class:`SimpleCNN` on the digits with the strategy of the
:class:`~manygpu.demo.config.DemoConfig` the command handed over
(:mod:`manygpu.runtime.handoff`), reports loss
and held-out accuracy per epoch on the main process, then, with several workers,
measures one worker alone on the same per-worker batch to state the speed-up and
scaling efficiency (with one worker it says what a multi-device run would show).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from manygpu.core.data import PreparedLoader
from manygpu.core.parallel import Parallel
from manygpu.demo.config import DemoConfig
from manygpu.demo.data import digits
from manygpu.demo.model import SimpleCNN
from manygpu.runtime import handoff


@dataclass
class DemoResult:
    """What the demo measured (written as JSON with ``--json``)."""

    strategy: str
    precision: str
    workers: int
    device: str
    threads_per_worker: int
    global_batch: int
    epochs: int
    losses: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)
    samples_per_s: float = 0.0
    single_worker_samples_per_s: float | None = None
    """One worker alone on the same per-worker batch; ``None`` when the job had one worker
    (comparing it with itself would only measure noise)."""
    step_times: list[dict[str, object]] = field(default_factory=list)
    """Every rank's step split of the last straggler report (``Parallel.step_times``)."""

    @property
    def speedup(self) -> float | None:
        """Throughput / one worker's; ``None`` without a comparison."""
        if not self.single_worker_samples_per_s:
            return None
        return self.samples_per_s / self.single_worker_samples_per_s

    @property
    def efficiency(self) -> float | None:
        """Speed-up / workers (1.0: linear scaling); ``None`` without a comparison."""
        return None if self.speedup is None else self.speedup / self.workers


def evaluate(par: Parallel, model: torch.nn.Module, loader: PreparedLoader) -> float:
    """Held-out accuracy over every test sample exactly once, summed over ranks."""
    model.eval()
    counts = torch.zeros(2, device=par.device)
    with torch.no_grad():
        for x, y in loader:
            counts[0] += (model(x).argmax(1) == y).sum()
            counts[1] += y.numel()
    model.train()
    total = par.reduce(counts, "sum")
    return float(total[0] / total[1])


def train_epoch(
    par: Parallel,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    loader: PreparedLoader,
    epoch: int,
) -> tuple[float, float, int]:
    """One epoch; returns (mean loss over ranks, seconds, samples seen by all ranks)."""
    loss_sum = torch.zeros(1, device=par.device)
    start, seen = time.perf_counter(), 0
    for x, y in par.progress(loader, description=f"epoch {epoch}"):
        loss = F.cross_entropy(model(x), y)
        par.backward(loss)
        opt.step()
        opt.zero_grad()
        loss_sum += loss.detach()
        seen += y.numel()
        par.console.set_status(f"loss {loss.item():.3f}")
    elapsed = time.perf_counter() - start
    mean_loss = par.reduce(loss_sum / max(len(loader), 1), "mean")
    return float(mean_loss), elapsed, seen * par.world_size


def single_worker_rate(
    par: Parallel, dataset: TensorDataset, batch: int, steps: int, image_size: int
) -> float:
    """Samples/s of one worker training alone (same batch, same threads).

    Runs on the main process while the others wait at a barrier, so it uses
    exactly the CPU share one worker of the job had.
    """
    if not par.is_main:
        return 0.0
    model = SimpleCNN(image_size).to(par.device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset, batch_size=batch, shuffle=True, drop_last=True)
    warmup, timed, start = 3, 0, 0.0
    while timed < steps:
        for i, (x, y) in enumerate(loader):
            if i == warmup and start == 0.0:
                start = time.perf_counter()
            x, y = x.to(par.device), y.to(par.device)
            with par.autocast():
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if start:
                timed += 1
            if timed >= steps:
                break
    if par.device.type == "cuda":
        torch.cuda.synchronize()
    return timed * batch / (time.perf_counter() - start)


def main(config: DemoConfig) -> DemoResult:
    """Train, evaluate and compare with one worker; the results on every rank."""
    with Parallel(strategy=config.strategy, precision=config.precision, split_batches=True) as par:
        train_set, test_set = digits(config.image_size)
        model = SimpleCNN(config.image_size)
        opt = torch.optim.Adam(model.parameters(), lr=config.lr)
        train = DataLoader(
            train_set, batch_size=config.global_batch_size, shuffle=True, drop_last=True
        )
        model, opt, train = par.prepare(model, opt, train)
        test = par.prepare_loader(DataLoader(test_set, batch_size=256), train=False)
        result = DemoResult(
            strategy=par.strategy_name,
            precision=config.precision,
            workers=par.world_size,
            device=str(par.device),
            threads_per_worker=torch.get_num_threads(),
            global_batch=config.global_batch_size,
            epochs=config.epochs,
        )
        par.print(
            f"[bold]manygpu demo[/]: {par.strategy_name} on {par.world_size} worker(s) "
            f"({par.device.type}, {result.threads_per_worker} thread(s) each), "
            f"{len(train_set)} training / {len(test_set)} held-out digits"
        )
        timed_s, timed_samples = 0.0, 0
        for epoch in range(1, config.epochs + 1):
            loss, seconds, samples = train_epoch(par, model, opt, train, epoch)
            acc = evaluate(par, model, test)
            result.losses.append(loss)
            result.accuracies.append(acc)
            if epoch > 1 or config.epochs == 1:  # epoch 1 includes warm-up
                timed_s, timed_samples = timed_s + seconds, timed_samples + samples
            par.print(
                f"epoch {epoch:2d}  loss {loss:.4f}  held-out accuracy {acc:.2%}  "
                f"({samples / seconds:,.0f} samples/s)"
            )
        result.samples_per_s = timed_samples / timed_s
        result.step_times = par.step_times
        if par.world_size > 1:  # one worker compared with one worker says nothing
            per_worker = config.global_batch_size // par.world_size
            steps = min(2 * len(train), 100)  # ~1-2 s: enough to average out noise
            rate = single_worker_rate(par, train_set, per_worker, steps, config.image_size)
            result.single_worker_samples_per_s = float(par.reduce(torch.tensor([rate]), "max"))
        report(par, result, config.json_path)
    return result


def summary(result: DemoResult) -> str:
    """The closing line: accuracy, throughput and, with several workers, the scaling.

    With one worker there is nothing to compare: the line says so and what a
    run on several devices would report, instead of a "speed-up" of one worker
    over one worker that only measures noise.
    """
    head = f"final held-out accuracy {result.accuracies[-1]:.2%}; "
    speedup, efficiency = result.speedup, result.efficiency
    if speedup is None or efficiency is None or result.single_worker_samples_per_s is None:
        return (
            f"{head}throughput {result.samples_per_s:,.0f} samples/s on one worker "
            f"({result.device}). One device, so no speed-up to measure: with N devices "
            "(every local GPU, or --workers N on the CPU) the demo compares N workers' "
            "samples/s with one worker's; ideally N times as many, a scaling efficiency of 100%."
        )
    return (
        f"{head}throughput {result.samples_per_s:,.0f} samples/s with {result.workers} workers "
        f"vs {result.single_worker_samples_per_s:,.0f} with one: "
        f"speed-up {speedup:.2f}x, scaling efficiency {efficiency:.0%}"
    )


def report(par: Parallel, result: DemoResult, json_path: str | None) -> None:
    """Final lines on the main process, and the JSON file when asked."""
    par.print(summary(result))
    if json_path and par.is_main:
        payload = asdict(result) | {"speedup": result.speedup, "efficiency": result.efficiency}
        with open(json_path, "w") as fh:
            json.dump(payload, fh, indent=2)


if __name__ == "__main__":
    main(handoff.received(DemoConfig))
