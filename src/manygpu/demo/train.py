"""The demo's worker: run by ``manygpu demo`` once per device via ``manygpu launch``.

Trains :class:`SimpleCNN` on the digits with the strategy of the
:class:`~manygpu.demo.config.DemoConfig` the command handed over
(:mod:`manygpu.runtime.handoff`), reports loss
and held-out accuracy per epoch on the main process. With several workers, each
epoch after the first is a timing window: one worker alone then trains the same
steps on the same per-worker batch, and the speed-up is the median over windows
with its spread and the machine's load (:mod:`manygpu.demo.windows`); with one
worker it says what a multi-device run would show.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from manygpu.core.data import PreparedLoader
from manygpu.core.parallel import Parallel
from manygpu.demo.config import DemoConfig
from manygpu.demo.data import digits
from manygpu.demo.model import SimpleCNN
from manygpu.demo.solo import SoloWorker, window_rate
from manygpu.demo.windows import (
    Load,
    Spread,
    Window,
    load_text,
    machine_load,
    speedup_spread,
    speedup_text,
    spread,
)
from manygpu.runtime import handoff
from manygpu.tracking.run import where_text


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
    """All workers together: the median over the timing windows."""
    single_worker_samples_per_s: float | None = None
    """One worker alone on the same per-worker batch (median over windows); ``None`` when
    the job had one worker (comparing it with itself would only measure noise)."""
    windows: list[Window] = field(default_factory=list)
    """Every timing window: an epoch after the first (or the only one)."""
    load: Load | None = None
    """The machine's load average when training began and ended."""
    step_times: list[dict[str, object]] = field(default_factory=list)
    """Every rank's step split of the last straggler report (``Parallel.step_times``)."""

    @property
    def speedup_spread(self) -> Spread | None:
        """The windows' speed-ups: median, lowest, highest; ``None`` without a comparison."""
        return speedup_spread(self.windows)

    @property
    def speedup(self) -> float | None:
        """The median window's speed-up (throughput / one worker's without windows);
        ``None`` without a comparison."""
        if (s := self.speedup_spread) is not None:
            return s.median
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
    """One epoch; returns (mean loss over ranks, seconds, samples seen by all ranks).

    With ``log_with``, every step goes to the trackers: loss, learning rate and
    step time (``par.log`` adds samples/s); the log's own collective is left
    out of the next step's time.
    """
    loss_sum = torch.zeros(1, device=par.device)
    start, seen = time.perf_counter(), 0
    last = start
    for x, y in par.progress(loader, description=f"epoch {epoch}"):
        loss = F.cross_entropy(model(x), y)
        par.backward(loss)
        opt.step()
        opt.zero_grad()
        loss_sum += loss.detach()
        seen += y.numel()
        par.console.set_status(f"loss {loss.item():.3f}")
        if par.config.log_with:
            lr = float(opt.param_groups[0]["lr"])
            par.log({"loss": loss.detach(), "lr": lr, "step_s": time.perf_counter() - last})
            last = time.perf_counter()
    elapsed = time.perf_counter() - start
    mean_loss = par.reduce(loss_sum / max(len(loader), 1), "mean")
    return float(mean_loss), elapsed, seen * par.world_size


def main(config: DemoConfig) -> DemoResult:
    """Train, evaluate and compare with one worker; the results on every rank."""
    with Parallel(
        strategy=config.strategy,
        precision=config.precision,
        split_batches=True,
        log_with=config.log_with,
        run_dir=config.run_dir,
    ) as par:
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
        solo = None
        if par.world_size > 1 and par.is_main:  # one worker compared with one says nothing
            per_worker = config.global_batch_size // par.world_size
            solo = SoloWorker(par, train_set, per_worker, config.image_size)
        load_start, cpus = machine_load()
        for epoch in range(1, config.epochs + 1):
            loss, seconds, samples = train_epoch(par, model, opt, train, epoch)
            acc = evaluate(par, model, test)
            result.losses.append(loss)
            result.accuracies.append(acc)
            line = f"({samples / seconds:,.0f} samples/s"
            if epoch > 1 or config.epochs == 1:  # epoch 1 includes warm-up
                window = timing_window(par, solo, samples / seconds, len(train))
                result.windows.append(window)
                if window.single_samples_per_s is not None:
                    line += f"; one worker alone {window.single_samples_per_s:,.0f}"
            par.print(f"epoch {epoch:2d}  loss {loss:.4f}  held-out accuracy {acc:.2%}  {line})")
        result.load = Load(start=load_start, end=machine_load()[0], cpus=cpus)
        _medians(result)
        result.step_times = par.step_times
        report(par, result, config.json_path)
        where_logged(par, config)
    return result


def where_logged(par: Parallel, config: DemoConfig) -> None:
    """Name the run the trackers wrote and how to look at it (main rank; with ``log_with``)."""
    state = par.job_state.tracking()
    if state is None:
        return
    where = where_text(tuple(config.log_with), config.run_dir or "runs", state["run_id"])
    par.print(f"logged run {state['run_id']}: {where}", markup=False)


def timing_window(par: Parallel, solo: SoloWorker | None, rate: float, steps: int) -> Window:
    """The epoch's throughput, then (with several workers) one worker's on as many steps."""
    if par.world_size == 1:
        return Window(workers_samples_per_s=rate)
    return Window(workers_samples_per_s=rate, single_samples_per_s=window_rate(par, solo, steps))


def _medians(result: DemoResult) -> None:
    """Throughputs as the windows' medians: one slow window does not set them."""
    workers = spread([w.workers_samples_per_s for w in result.windows])
    single = spread([w.single_samples_per_s for w in result.windows if w.single_samples_per_s])
    result.samples_per_s = workers.median if workers else 0.0
    result.single_worker_samples_per_s = single.median if single else None


def summary(result: DemoResult) -> str:
    """The closing line: accuracy, throughput and, with several workers, the scaling.

    With one worker there is nothing to compare: the line says so and what a
    run on several devices would report, instead of a "speed-up" of one worker
    over one worker that only measures noise. With several, the speed-up is the
    median window's, with the windows' range and the machine's load beside it.
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
    s = result.speedup_spread
    scaling = f"speed-up {speedup:.2f}x" if s is None else speedup_text(s)
    line = (
        f"{head}throughput {result.samples_per_s:,.0f} samples/s with {result.workers} workers "
        f"vs {result.single_worker_samples_per_s:,.0f} with one: "
        f"{scaling}, scaling efficiency {efficiency:.0%}"
    )
    if result.load is not None:
        line += f"; {load_text(result.load, result.workers, s)}"
    return line


def report(par: Parallel, result: DemoResult, json_path: str | None) -> None:
    """Final lines on the main process, and the JSON file when asked."""
    par.print(summary(result))
    if json_path and par.is_main:
        s = result.speedup_spread
        payload = asdict(result) | {
            "speedup": result.speedup,
            "efficiency": result.efficiency,
            "speedup_spread": None if s is None else asdict(s),
        }
        with open(json_path, "w") as fh:
            json.dump(payload, fh, indent=2)


if __name__ == "__main__":
    main(handoff.received(DemoConfig))
