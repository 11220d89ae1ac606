"""Checkpoints to local disk against an S3-protocol server on loopback, blocking and async.

One process (strategy ``single``), a 3 x Linear(2048, 2048) model (12.6M
parameters, 50 MB) with Adam state (150 MB per checkpoint). The S3 server is
moto's (``python -m moto.server``, in a process of its own on 127.0.0.1, so its
work does not share this process's interpreter lock). moto is a Python server
that checksums every part it receives: it, not the network, is likely the
limit on upload speed here, so the ``s3`` rows show the stall the training
loop sees and the cost of the protocol on loopback, not a real store's
throughput. Each round runs every variant, in a rotating order:

- ``disk`` / ``s3``: where the checkpoint goes (a local directory / ``s3://``);
- ``full`` / ``dcp``: the format; ``-async``: ``async_save=True``.

"stall" is how long ``save()`` blocks the training loop (for async saves, the
copy into the reused CPU buffers); "save" is until the step is committed
(``wait()``); "resume" loads it back (for ``s3``: download, verify, load).
The second save of each run is timed (the first allocates the async buffers);
"+RSS" is how far the process's resident memory rose above its level before
that save, until it was committed (sampled every 5 ms): the memory a save
takes besides the reused snapshot buffers.

    python bench/checkpoint_store.py [--rounds 3]

Prints a table and writes bench/results/checkpoint_store.json (or --json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("full", "full-async", "dcp", "dcp-async")
VARIANTS = tuple(f"{where}-{fmt}" for where in ("disk", "s3") for fmt in FORMATS)
BUCKET = "bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server() -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """moto's S3 server on 127.0.0.1 in its own process, and the AWS variables that reach it."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, env
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("moto's server did not start")


class _PeakRss:
    """The most this process's resident memory rose above its level at entry (sampled)."""

    def __init__(self, every_s: float = 0.005) -> None:
        import psutil

        self._proc, self._every = psutil.Process(), every_s
        self.extra = 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(self._every):
            self.extra = max(self.extra, self._proc.memory_info().rss - self._base)

    def __enter__(self) -> _PeakRss:
        self._base = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _one(par: Any, model: Any, opt: Any, where: str, variant: str) -> dict[str, float]:
    from manygpu.checkpoint import Checkpointer, TrainState

    fmt = variant.split("-")[1]
    ckpt = Checkpointer(
        par,
        where,
        model=model,
        optimizer=opt,
        keep=2,
        format=fmt,
        async_save=variant.endswith("-async"),
        handle_signals=False,
    )
    row = {}
    for step in (1, 2):
        with _PeakRss() as rss:
            start = time.perf_counter()
            ckpt.save(TrainState(step=step))
            row["stall_s"] = time.perf_counter() - start
            ckpt.wait()
            row["save_s"] = time.perf_counter() - start
        row["extra_mb"] = rss.extra / 2**20
    start = time.perf_counter()
    ckpt.resume()
    row["resume_s"] = time.perf_counter() - start
    ckpt.close()
    return row


def run(rounds: int, scratch: Path) -> dict[str, Any]:
    import torch
    from torch import nn

    from manygpu.checkpoint_io import remote, remote_layout
    from manygpu.core.parallel import Parallel

    par = Parallel(strategy="single")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(3)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, opt = par.prepare(model, opt)
    par.backward(model(torch.randn(2, 2048)).sum())
    opt.step()  # Adam's exp_avg / exp_avg_sq exist
    rows = []
    for rnd in range(rounds):
        turn = rnd % len(VARIANTS)
        for variant in VARIANTS[turn:] + VARIANTS[:turn]:  # rotate the order
            name = f"{variant}-{rnd}-{uuid.uuid4().hex[:6]}"
            where = str(scratch / name) if variant.startswith("disk") else f"s3://{BUCKET}/{name}"
            row = _one(par, model, opt, where, variant)
            rows.append({"variant": variant, "round": rnd, **row})
            print(
                f"round {rnd} {variant:<15} stall {row['stall_s']:6.3f}s  "
                f"save {row['save_s']:6.2f}s  resume {row['resume_s']:6.2f}s  "
                f"+{row['extra_mb']:.0f} MB",
                flush=True,
            )
            if variant.startswith("disk"):
                shutil.rmtree(where, ignore_errors=True)
            else:  # the server holds every object until deleted
                remote_layout.remove(remote.connect(where))
    params = sum(p.numel() for p in model.parameters())
    par.close()
    return {"parameters": params, "rows": rows}


def summarize(data: dict[str, Any], command: str) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    from manygpu.bench.report import machine_info

    table = Table(
        title=f"checkpoint of {data['parameters'] / 1e6:.1f}M parameters + Adam, 1 process "
        "(median over rounds)"
    )
    for col in ("variant", "stall (s)", "save (s)", "resume (s)", "save x disk", "+RSS (MB)"):
        table.add_column(col, justify="right")
    summary: dict[str, Any] = {}
    for variant in VARIANTS:
        rows = [r for r in data["rows"] if r["variant"] == variant]
        summary[variant] = {
            k: statistics.median(r[k] for r in rows)
            for k in ("stall_s", "save_s", "resume_s", "extra_mb")
        }
    for variant in VARIANTS:
        med = summary[variant]
        disk = summary["disk-" + variant.split("-", 1)[1]]
        med["save_vs_disk"] = med["save_s"] / disk["save_s"]
        table.add_row(
            variant,
            f"{med['stall_s']:.3f}",
            f"{med['save_s']:.2f}",
            f"{med['resume_s']:.2f}",
            f"{med['save_vs_disk']:.2f}",
            f"{med['extra_mb']:.0f}",
        )
    Console(soft_wrap=True, width=160).print(table)
    return {"command": command, "machine": machine_info(), "summary": summary, **data}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "checkpoint_store.json"))
    args = p.parse_args()
    server, env = start_server()
    os.environ.update(env)
    scratch = Path(tempfile.mkdtemp(prefix="mg-store-bench-"))
    try:
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(BUCKET)
        data = run(args.rounds, scratch)
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)
    result = summarize(data, " ".join(["python", *sys.argv]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
