"""One rank of ``bench/prepare_memory.py``: build, shard, train one step, and meter RSS.

Launched by ``manygpu launch`` (so it sees what a user's job sees, allocator
settings included). Each phase resets the kernel's peak-RSS mark first
(``/proc/self/clear_refs``: "5"), so ``VmHWM`` read at its end is that phase's
own peak; the run's peak is the highest of them. Everything is measured above
this rank's baseline, taken after the process group exists and before the
model is built. Rank r writes ``rank{r}.json`` into the output folder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from manygpu.runtime import env as envmod
from manygpu.runtime.host_memory import fix_mmap_threshold, release_host_memory

_STATUS = re.compile(r"^(VmRSS|VmHWM):\s+(\d+) kB", re.MULTILINE)


def vm() -> dict[str, int]:
    """This process's resident set now and its peak since the last reset, in bytes."""
    text = Path("/proc/self/status").read_text()
    return {k: int(v) * 1024 for k, v in _STATUS.findall(text)}


def reset_peak() -> None:
    """Start a new peak: VmHWM becomes VmRSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


PREPARE_PHASES = {"prepare", "materialize", "prepare+load"}


class Meter:
    """Per-phase RSS: after the phase, and the phase's peak, both above the baseline."""

    def __init__(self, cfg: dict[str, Any] | None = None) -> None:
        cfg = cfg or {}
        self.trim_after = PREPARE_PHASES if cfg.get("in_process") else set()
        """Phases ending in ``malloc_trim(0)``: all of them with ``trim``, the prepare
        phases with ``in_process`` (what manygpu's prepare would do)."""
        if cfg.get("trim"):
            self.trim_after = {"*"}
        reset_peak()
        self.baseline = vm()["VmRSS"]
        self.rows: list[dict[str, Any]] = []
        self.loss: float | None = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        reset_peak()
        start = time.perf_counter()
        yield
        if name in self.trim_after or "*" in self.trim_after:
            release_host_memory()
        now = vm()
        self.rows.append(
            {
                "phase": name,
                "rss_after": now["VmRSS"] - self.baseline,
                "peak": now["VmHWM"] - self.baseline,
                "seconds": time.perf_counter() - start,
            }
        )


# --- the model: a GPT whose layer names the tensor strategy's plan knows ---------


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v/out projections."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim, bias=False) for _ in "qkv")
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads / tp of them.
        q, k, v = (
            p(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """nanoGPT's layout: token + position embeddings, a ModuleList of blocks, a tied head."""

    def __init__(self, vocab: int, context: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


VOCAB, CONTEXT, HEADS = 8192, 64, 16


def layers_for(size_gb: float, dim: int) -> int:
    """Blocks that bring the model's fp32 parameters closest to ``size_gb``."""
    per_block = 12 * dim * dim + 13 * dim
    fixed = (VOCAB + CONTEXT + 2) * dim
    return max(1, round((size_gb * 1e9 / 4 - fixed) / per_block))


class Embed(nn.Module):
    def __init__(self, vocab: int, context: int, dim: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(context, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


def build(cfg: dict[str, Any]) -> nn.Module:
    """The GPT; for ``pipeline`` the same layers as an ``nn.Sequential`` (head untied:
    its stages hold different layers)."""
    dim, layers = cfg["dim"], layers_for(cfg["size_gb"], cfg["dim"])
    if cfg.get("strategy") != "pipeline":
        return GPT(VOCAB, CONTEXT, dim, HEADS, layers)
    blocks = [Block(dim, HEADS) for _ in range(layers)]
    head = nn.Linear(dim, VOCAB, bias=False)
    return nn.Sequential(Embed(VOCAB, CONTEXT, dim), *blocks, nn.LayerNorm(dim), head)


def _lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def model_bytes(model: nn.Module) -> int:
    """fp32 bytes of the whole model's parameters (tied ones once), whatever their device."""
    return sum(p.numel() * 4 for p in model.parameters())


def init_local(model: nn.Module) -> None:
    """A cheap deterministic init of this rank's own part (the shard, not the whole)."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            local = p.to_local() if hasattr(p, "to_local") else p
            g = torch.Generator().manual_seed(1000 + i)
            local.normal_(0.0, 0.02, generator=g)


def batch(rows: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(VOCAB, (rows, 16), generator=g)
    return x, torch.randint(VOCAB, (rows, 16), generator=g)


# --- the modes ------------------------------------------------------------------


def strategy_args(name: str) -> dict[str, Any]:
    """``Parallel(...)`` keywords for a strategy row of the bench."""
    rows: dict[str, dict[str, Any]] = {
        "fsdp": {"strategy": "fsdp"},
        "hsdp": {"strategy": "fsdp", "mesh": {"dp": 2, "fsdp": 2}},
        "ddp": {"strategy": "ddp"},
        "tensor": {"strategy": "tensor", "mesh": {"tp": 4}},
        "dp2xtp2": {"strategy": "tensor", "mesh": {"dp": 2, "tp": 2}},
    }
    if name == "pipeline":  # one stage per rank, balanced by parameters
        from manygpu import Pipeline

        return {"strategy": Pipeline(loss_fn=_lm_loss, microbatches=4)}
    return rows[name]


def train_step(meter: Meter, model: nn.Module, opt: Any, backward: Any) -> None:
    if hasattr(model, "is_last"):  # a pipeline runs forward and backward in one call
        x, y = batch(rows=4)  # one row per micro-batch, one micro-batch per stage
        with meter.phase("forward+backward"):
            backward(model(x, target=y))
        with meter.phase("step"):
            opt.step()
        return
    x, y = batch()
    with meter.phase("forward"):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    meter.loss = float(loss.detach())
    with meter.phase("backward"):
        backward(loss)
    with meter.phase("step"):
        opt.step()


def run_whole(cfg: dict[str, Any]) -> tuple[Meter, int]:
    """Today's path: every rank builds the model with values, then ``prepare``."""
    from manygpu import Parallel

    par = Parallel(**strategy_args(cfg["strategy"]))
    meter = Meter(cfg)
    with meter.phase("build"):
        torch.manual_seed(0)
        model = build(cfg)
        size = model_bytes(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with meter.phase("prepare"):
        model, opt = par.prepare(model, opt)
    train_step(meter, model, opt, par.backward)
    return meter, size


def run_init_module(cfg: dict[str, Any]) -> tuple[Meter, int]:
    """The path issue work adds: ``init_module`` (meta), then ``prepare(weights=...)``."""
    from manygpu import Parallel

    par = Parallel(**strategy_args(cfg["strategy"]))
    meter = Meter(cfg)
    with meter.phase("build"):
        with par.init_module():  # type: ignore[attr-defined]
            model = build(cfg)
        size = model_bytes(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with meter.phase("prepare+load"):
        model, opt = par.prepare(model, opt, weights=cfg["weights"])
    train_step(meter, model, opt, par.backward)
    return meter, size


def run_meta_manual(cfg: dict[str, Any]) -> tuple[Meter, int]:
    """The floor, by hand: meta build, ``fully_shard`` per block then root, ``to_empty``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if cfg["strategy"] not in ("fsdp", "hsdp"):
        raise SystemExit(f"meta-manual covers fsdp and hsdp, not {cfg['strategy']}")
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if cfg["strategy"] == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "fsdp"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    meter = Meter(cfg)
    with meter.phase("build"):
        with torch.device("meta"):
            model = build(cfg)
        size = model_bytes(model)
    with meter.phase("shard"):
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    with meter.phase("materialize"):
        model.to_empty(device="cpu")
        init_local(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    train_step(meter, model, opt, lambda loss: loss.backward())
    return meter, size


def fsdp_defaults(model: nn.Module) -> None:
    """FSDP2's own backward prefetch and gloo reduce-scatter back on every unit: the
    "before" of ``bench/fsdp_cpu_step.py`` (manygpu sets both on a CPU mesh:
    ``strategies/fsdp/host.py``). Reaches into FSDP2's state: a bench, not the library."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit._get_fsdp_state()._states_to_backward_prefetch = []
            unit.set_custom_reduce_scatter(DefaultReduceScatter())


def run_loop(cfg: dict[str, Any]) -> tuple[Meter, int]:
    """The cost side: a small training loop, timed (``cfg["steps"]`` after 3 warm-up steps)."""
    import torch.distributed as dist

    from manygpu import Parallel

    par = Parallel(**strategy_args(cfg["strategy"]))
    torch.manual_seed(0)
    model = build(cfg)
    size = model_bytes(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = par.prepare(model, opt)
    if cfg.get("fsdp_defaults"):
        fsdp_defaults(model)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(VOCAB, (cfg["batch"], CONTEXT), generator=g)
    meter = Meter()
    for step in range(3 + cfg["steps"]):
        if step == 3:
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        par.backward(loss)
        opt.step()
        opt.zero_grad()
    cpu_s = (time.process_time() - cpu) / cfg["steps"]
    dist.barrier()
    meter.rows.append(
        {"phase": "loop", "rss_after": vm()["VmRSS"] - meter.baseline,
         "peak": vm()["VmHWM"] - meter.baseline,
         "seconds": (time.perf_counter() - start) / cfg["steps"], "cpu_seconds": cpu_s}
    )  # fmt: skip
    return meter, size


MODES = {
    "whole": run_whole,
    "meta-manual": run_meta_manual,
    "init_module": run_init_module,
    "loop": run_loop,
}


def enter_cap(cfg: dict[str, Any], rank: int) -> int | None:
    """Put this rank under its memory cgroup (``cfg["cap_dirs"][rank]``, made by the
    caller), limited to what the rank holds now plus ``cfg["cap_extra"]`` bytes; the
    limit, or None when no cap was asked for. Counting the rank's own resident set
    keeps the cap about the work ahead, not about what importing torch took."""
    if not cfg.get("cap_dirs"):
        return None
    group = Path(cfg["cap_dirs"][rank])
    limit = vm()["VmRSS"] + int(cfg["cap_extra"])
    name = "memory.max" if cfg["cap_kind"] == "cgroup2" else "memory.limit_in_bytes"
    (group / name).write_text(str(limit))
    (group / "cgroup.procs").write_text(str(os.getpid()))
    return limit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="JSON: mode, strategy, size_gb, dim...")
    cfg = json.loads(parser.parse_args().config)
    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    if cfg.get("in_process"):  # what Parallel(...) does for a strategy that splits weights
        fix_mmap_threshold(envmod.user_set_malloc(envmod.current()))
    rank = int(os.environ.get("RANK", "0"))
    cap_limit = enter_cap(cfg, rank)
    meter, size = MODES[cfg["mode"]](cfg)
    out = {
        "rank": rank,
        "model_bytes": size,
        "cap_limit": cap_limit,
        "loss": meter.loss,
        "baseline": meter.baseline,
        "phases": meter.rows,
        "peak": max(r["peak"] for r in meter.rows),
        "env": {k: v for k, v in os.environ.items() if "MALLOC" in k or k == "GLIBC_TUNABLES"},
        "layers": layers_for(cfg["size_gb"], cfg["dim"]),
    }
    path = Path(cfg["out_dir"]) / f"rank{rank}.json"
    path.write_text(json.dumps(out))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()
