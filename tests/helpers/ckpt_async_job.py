"""A job whose second asynchronous save hangs mid-write, waiting to be killed.

``python ckpt_async_job.py CKPT_DIR OUT_DIR FORMAT``: trains the ckpt_job model,
saves step 3 asynchronously in FORMAT (``full`` or ``dcp``) and waits for it
(``OUT_DIR/params-3.pt`` holds its parameters), trains on, then saves step 6
with a writer that stops after the first buffer of ``model.pt`` (``full``) or
of its DCP shard (``dcp``) and writes ``OUT_DIR/writing``: the parent kills
the process with SIGKILL while the background write is in progress.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch
from ckpt_job import build
from torch import nn

from manygpu import Parallel
from manygpu.checkpoint import TrainState
from manygpu.checkpoint_io import writer


def _hang_in_model_file(marker: Path) -> None:
    real = writer.DurableFile.write
    never = threading.Event()

    def write(self: writer.DurableFile, data: object) -> int:
        n = real(self, data)
        held = self.path.name == "model.pt" or self.path.suffix == ".distcp"
        if held and "step-00000006" in str(self.path):
            # Renamed into place: the parent polls for the marker and reads it at once.
            marker.with_suffix(".part").write_text(str(self.path))
            marker.with_suffix(".part").rename(marker)
            never.wait()  # the background thread stops here until the kill
        return n

    writer.DurableFile.write = write  # type: ignore[method-assign]


def main(directory: Path, out: Path, fmt: str) -> None:
    with Parallel(strategy="single") as par:
        model, opt, sched, loader, ckpt = build(par, directory, every=0, fmt=fmt, async_save=True)
        state = TrainState()
        for x, y in loader:
            par.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            sched.step()
            state.step += 1
            if state.step == 3:
                ckpt.save(state)
                ckpt.wait()
                params = [p.detach().clone() for p in par.unwrap(model).parameters()]
                torch.save(params, out / "params-3.pt")
            if state.step == 6:
                _hang_in_model_file(out / "writing")
                ckpt.save(state)  # returns at once; the write hangs in the background
                break
        threading.Event().wait()  # training "goes on" until the parent kills us


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
