"""Expert parallelism on CPU: tokens/s and all-to-all time at ep = 1, 2.

A torchtitan-style grouped MoE (tests/helpers/moe_models.py: 2 layers, 8
experts, top-2, dim 256, hidden 512) trains with AdamW under
``Parallel(mesh={"ep": N})``, each rank 4 sequences of 128 tokens (the
global batch grows with ep, as under data parallelism), 1 thread per rank,
gloo on loopback. The all-to-all time is the forward's (count exchange,
dispatch, combine) measured around manygpu's calls, waits included; the
backward runs the reverse pair, about as long again.

    python bench/expert_parallel.py [--steps 12] [--warmup 3] [--ep 1,2]

Prints a table and writes bench/results/expert_parallel.json.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests" / "helpers")]

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from manygpu.bench.report import machine_info, write_json  # noqa: E402

SEQS, SEQ, DIM, HIDDEN, EXPERTS, LAYERS = 4, 128, 256, 512, 8, 2


def _timed(module: Any, name: str, spent: list[float]) -> None:
    """Wrap ``module.name`` so every call adds its wall time to ``spent``."""
    inner = getattr(module, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    setattr(module, name, call)


def _worker(rank: int, world: int, port: int, steps: int, warmup: int, out: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")  # fmt: skip
    torch.set_num_threads(1)
    from moe_models import VOCAB, GroupedMoEModel

    from manygpu import Parallel
    from manygpu.strategies.expert import dispatch
    from manygpu.warn import UnpreparedDataWarning

    # Each rank draws its own tokens (its own generator): the data is sharded by hand.
    warnings.simplefilter("ignore", UnpreparedDataWarning)

    spent: list[float] = []
    _timed(dispatch, "_a2a", spent)
    _timed(dispatch, "exchange_counts", spent)
    par = Parallel(mesh={"ep": world})
    try:
        torch.manual_seed(0)
        model = par.prepare(GroupedMoEModel(LAYERS, EXPERTS, DIM, HIDDEN))
        opt = par.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
        gen = torch.Generator().manual_seed(rank)
        times, comm = [], []
        for step in range(warmup + steps):
            tokens = torch.randint(0, VOCAB, (SEQS, SEQ), generator=gen)
            spent.clear()
            start = time.perf_counter()
            logits = model(tokens)[:, :-1]
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            par.backward(loss)
            opt.step()
            opt.zero_grad()
            if step >= warmup:
                times.append(time.perf_counter() - start)
                comm.append(sum(spent))
        if rank == 0:
            out.put({"ep": world, "step_s": statistics.median(times),
                     "a2a_forward_s": statistics.median(comm)})  # fmt: skip
    finally:
        par.close()


def run(world: int, steps: int, warmup: int) -> dict[str, Any]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(_worker, (world, port, steps, warmup, out), nprocs=world,
                       start_method="spawn")  # fmt: skip
    row = out.get(timeout=60)
    row["tokens_per_s"] = world * SEQS * SEQ / row["step_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--ep", default="1,2")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "expert_parallel.json"))
    args = parser.parse_args()
    rows = [run(int(n), args.steps, args.warmup) for n in args.ep.split(",")]
    print("| ep | ranks | tokens/s | step s | forward all-to-all s | share |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        share = r["a2a_forward_s"] / r["step_s"]
        print(f"| {r['ep']} | {r['ep']} | {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | "
              f"{r['a2a_forward_s']:.4f} | {share:.1%} |")  # fmt: skip
    shape = {"seqs_per_rank": SEQS, "seq": SEQ, "dim": DIM, "hidden": HIDDEN,
             "experts": EXPERTS, "layers": LAYERS}  # fmt: skip
    write_json(Path(args.out), {"machine": machine_info(), "rows": rows, "shape": shape})


if __name__ == "__main__":
    main()
