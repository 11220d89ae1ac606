"""A model bigger than the GPU, prepared and trained under fsdp with CPU offload.

The GPU is capped (``torch.cuda.set_per_process_memory_fraction``) below the
model's fp32 weights, so "bigger than one device" holds on any card: with one
GPU lent for a few minutes, a 35B-parameter model (whose fp32 weights pass an
H200's 139 GiB) would not fit the machine's 128 GiB of host memory either,
and the path under test is the same at any size. The model (an MLP stack of
``--blocks`` blocks of ``--dim``) is built under ``par.init_module()``,
sharded (one rank: each block its own FSDP2 unit) and offloaded before a byte
is allocated, initialised block by block, then trained ``--steps`` SGD steps.

Printed and written as JSON: the model's bytes, the cap, peak CUDA memory
(``torch.cuda.max_memory_allocated``) through prepare and through training,
peak host RSS (VmHWM), and seconds for prepare and per step. A whole-model
``.to("cuda")`` under the same cap is tried last and must fail.

    python bench/big_model_gpu.py --out bench/results/big_model_gpu.json
    python bench/big_model_gpu.py --blocks 2 --dim 256 --cap-gb 0   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from manygpu import FSDP, Parallel


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, blocks: int, dim: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _vmhwm_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--cap-gb", type=float, default=8.0, help="GPU cap (0: no cap, CPU runs)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out", default="bench/results/big_model_gpu.json")
    ns = ap.parse_args()
    cuda = torch.cuda.is_available()
    if cuda and ns.cap_gb > 0:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(ns.cap_gb * 1e9 / total)
    row: dict[str, object] = {"device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    # param_dtype: FSDP2 gathers each unit in bf16. Without it, bf16 autocast would
    # cache a bf16 copy of every weight from forward to backward: a whole model's
    # worth (2 bytes a parameter) on the GPU, which is what the cap is there to refuse.
    strategy = FSDP(cpu_offload=True, param_dtype="bf16" if cuda else None)
    with Parallel(strategy=strategy, timeout_s=600) as par:
        start = time.perf_counter()
        with par.init_module():
            model = Stack(ns.blocks, ns.dim)
        model_bytes = sum(p.numel() * 4 for p in model.parameters())
        model = par.prepare(model)
        opt = par.prepare(torch.optim.SGD(model.parameters(), lr=1e-4))
        prepare_s = time.perf_counter() - start
        prepare_peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0
        x = torch.randn(ns.tokens, ns.dim, device=par.device)
        steps = []
        for _ in range(ns.steps):
            t = time.perf_counter()
            loss = model(x).float().pow(2).mean()
            par.backward(loss)
            opt.step()
            opt.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            steps.append(time.perf_counter() - t)
        row |= {
            "params_b": model_bytes / 4 / 1e9, "model_gb": model_bytes / 1e9,
            "cap_gb": ns.cap_gb, "prepare_s": prepare_s, "step_s": steps,
            "cuda_peak_prepare_gb": prepare_peak,
            "cuda_peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
            "host_vmhwm_gb": _vmhwm_gb(), "loss": float(loss.detach()),
        }  # fmt: skip
    if cuda and ns.cap_gb > 0:
        try:
            torch.empty(model_bytes, dtype=torch.uint8, device="cuda")
            row["whole_model_fits_cap"] = True
        except torch.OutOfMemoryError:
            row["whole_model_fits_cap"] = False
    print(
        " | ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
    )
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
