"""``manygpu plan``: memory and speed of every strategy for a model on a cluster, and a pick."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from manygpu.errors import UsageError
from manygpu.flags import (
    fraction,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
)

if TYPE_CHECKING:
    from rich.table import Table

    from manygpu.plan.desc import ModelDesc
    from manygpu.plan.hardware import Cluster
    from manygpu.plan.recommend import Plan

DESCRIPTION = """Estimate per-device memory (parameters, gradients, optimizer state,
gathered weights, activations: what manygpu allocates, whose mixed precision is
autocast over fp32 weights) and step time / scaling efficiency (alpha-beta ring all-reduce with
DDP's bucketed overlap) of ddp, zero1, zero2, fsdp, pipeline and tensor parallelism,
and recommend one. The model is a published one (resnet50, gpt2, gpt2-medium), a
built-in or module:function workload (measured on this CPU), or numbers: --params
(and --layers/--hidden/--seq for a transformer; --experts/--top-k/--expert-params
for a mixture of experts, which adds expert parallelism). Compute is timed at what each
device reaches in training at the precision (published figures, not the data-sheet
peak); without FLOPs (--params alone) plans are ranked by memory only. The
cluster is a preset (p100-roce25, v100, t4, a100, h100) resized by --nodes and
--gpus-per-node, with any field overridden, or 'this' (measured here). Each
plan comes with the Parallel(...) line that runs what was counted."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="predict memory and speed-up; recommend a strategy",
                       description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument(
        "--model",
        default="",
        help="resnet50, gpt2, gpt2-medium, demo-cnn, resnet, gpt or module:function",
    )
    p.add_argument("--params", type=nonnegative_float, default=0, help="parameter count, e.g. 7e9")
    p.add_argument("--layers", type=nonnegative_int, default=0)
    p.add_argument("--hidden", type=nonnegative_int, default=0)
    p.add_argument("--seq", type=nonnegative_int, default=0, help="sequence length (tokens)")
    p.add_argument("--heads", type=nonnegative_int, default=0)
    p.add_argument(
        "--experts",
        type=nonnegative_int,
        default=0,
        help="a mixture of experts: experts per layer (with --params and the shape)",
    )
    p.add_argument("--top-k", type=nonnegative_int, default=0, help="experts per token")
    p.add_argument("--expert-params", type=nonnegative_float, default=0,
                   help="parameters inside the experts, all layers (part of --params)")  # fmt: skip
    p.add_argument(
        "--flops-per-sample",
        type=nonnegative_float,
        default=0,
        help="forward+backward FLOPs, 2 per multiply-add (ResNet-50: 24.3e9)",
    )
    p.add_argument("--activation-mb", type=nonnegative_float, default=0,
                   help="saved-for-backward MB per sample in fp32 (with --params)")  # fmt: skip
    p.add_argument("--cluster", default="h100", help="preset name or 'this'")
    p.add_argument("--nodes", type=positive_int, default=1)
    p.add_argument("--gpus-per-node", type=positive_int, help="devices (or CPU processes) per node")
    p.add_argument("--gpu-memory-gb", type=positive_float)
    p.add_argument("--peak-tflops", type=positive_float,
                   help="a device outside the table: its dense peak at the precision "
                   "(--mfu of it, default 0.4, is assumed reached)")  # fmt: skip
    p.add_argument("--intra-gbs", type=positive_float, help="ring bandwidth inside a node, GB/s")
    p.add_argument("--intra-latency-us", type=positive_float)
    p.add_argument("--inter-gbs", type=positive_float, help="network bandwidth per node, GB/s")
    p.add_argument("--inter-latency-us", type=positive_float)
    p.add_argument("--batch", type=positive_int, default=32, help="samples per replica per step")
    p.add_argument("--precision", default="auto",
                   help="auto (bf16, else fp16, else fp32: the device's best), fp32, tf32, "
                   "bf16 or fp16 (mixed)")  # fmt: skip
    p.add_argument("--optimizer", default="adam", help="adam, adamw, sgd-momentum, sgd")
    p.add_argument("--mfu", type=fraction, default=None,
                   help="assume this fraction of the peak, not the table's rates")  # fmt: skip
    p.add_argument("--json", default="", help="also write the plan here")
    p.set_defaults(run=run)


def build_cluster(ns: argparse.Namespace) -> Cluster:
    from manygpu.plan import hardware

    if ns.cluster == "this":
        from manygpu.plan.probe import this_machine

        cluster = this_machine(ns.gpus_per_node or 2)
    else:
        cluster = hardware.preset(ns.cluster, nodes=ns.nodes, gpus_per_node=ns.gpus_per_node)
    if ns.peak_tflops is not None:  # a device outside the table: its peak, not the table's rates
        cluster = replace(cluster, device=None, peak_tflops=ns.peak_tflops)
    overrides = {
        "memory_gb": ns.gpu_memory_gb,
        "intra_bw_gbs": ns.intra_gbs,
        "intra_latency_us": ns.intra_latency_us,
        "inter_bw_gbs": ns.inter_gbs,
        "inter_latency_us": ns.inter_latency_us,
    }
    return replace(cluster, **{k: v for k, v in overrides.items() if v is not None})


def build_desc(ns: argparse.Namespace, measure_step: bool) -> ModelDesc:
    from manygpu.plan.desc import ModelDesc, transformer

    if bool(ns.model) == bool(ns.params):
        raise UsageError("give either --model or --params")
    shape = {"--layers": ns.layers, "--hidden": ns.hidden, "--seq": ns.seq}
    if any(shape.values()) and not all(shape.values()):
        missing = ", ".join(k for k, v in shape.items() if not v)
        raise UsageError(
            f"a transformer's shape needs --layers, --hidden and --seq together; add {missing}"
        )
    if ns.params:
        moe = {"--experts": ns.experts, "--top-k": ns.top_k, "--expert-params": ns.expert_params}
        if any(moe.values()) and not (all(moe.values()) and all(shape.values())):
            raise UsageError(
                "a mixture of experts needs --experts, --top-k and --expert-params together, "
                "with --layers, --hidden and --seq"
            )
        if all(shape.values()):
            return transformer("custom transformer", parameters=int(ns.params), layers=ns.layers,
                               hidden=ns.hidden, seq_len=ns.seq, heads=ns.heads,
                               expert_parameters=int(ns.expert_params), num_experts=ns.experts,
                               experts_per_token=ns.top_k)  # fmt: skip
        return ModelDesc(name="custom", parameters=int(ns.params),
                         flops_per_sample=ns.flops_per_sample,
                         activation_bytes_per_sample=ns.activation_mb * 1e6)  # fmt: skip
    from manygpu.plan.published import MODELS

    if ns.model in MODELS:
        return MODELS[ns.model]()
    from manygpu.bench import models
    from manygpu.plan.desc import describe

    w = models.build(ns.model)
    return describe(w.name, w.model, w.make_batch, w.loss,
                    time_batch=ns.batch if measure_step else 0)  # fmt: skip


SPEED_COLUMNS = ("step ms", "exposed comm ms", "efficiency", "samples/s")
SPEED_UNKNOWN = (
    "speed not estimated (no FLOPs per sample): plans are ranked by memory fit only; "
    "add --layers, --hidden and --seq (or --flops-per-sample, or a named --model) to rank by speed"
)


def table(plan: Plan, acts_known: bool = True) -> Table:
    """Every candidate's memory (and speed, when any was estimated) as a rich table."""
    from rich.table import Table

    timed = any(c.step for c in plan.candidates)
    out = Table(title=f"manygpu plan: {plan.world_size} device(s)")
    for name in ("strategy", "layout", "params GB", "grads GB", "optim GB", "gathered GB",
                 "acts GB", "total GB", "prepare GB", "fits", "checkpointing",
                 *(SPEED_COLUMNS if timed else ())):  # fmt: skip
        words = name in ("strategy", "layout")
        # One word a line ("gathered" over "GB"): the columns are as narrow as their
        # words, so the table fits where it fits at all; a terminal narrower still
        # folds a header or a value rather than cutting it ("gather…").
        out.add_column(name.replace(" ", "\n"), justify="left" if words else "right",
                       no_wrap=words, overflow="fold")  # fmt: skip
    for c in plan.candidates:
        m, step = c.memory, c.step
        speed = ["n/a"] * 4
        if step:
            speed = [f"{step.step_s * 1e3:,.1f}", f"{step.exposed_s * 1e3:,.1f}",
                     f"{step.efficiency:.1%}", f"{step.samples_per_s:,.0f}"]  # fmt: skip
        out.add_row(
            c.strategy, c.recipe.layout(),
            *(f"{v / 1e9:,.3f}" for v in (m.params, m.grads, m.optimizer, m.gathered)),
            f"{m.activations / 1e9:,.3f}" if acts_known else "?", f"{m.total / 1e9:,.3f}",
            f"{m.prepare / 1e9:,.3f}", "yes" if c.fits else "no", _checkpointing(c),
            *(speed if timed else ()),
        )  # fmt: skip
    return out


def _checkpointing(c: Any) -> str:
    """A row's activation checkpointing: the mode, the activations it saves, its recompute."""
    mode = c.recipe.checkpointing
    if mode is None:
        return "-"
    return f"{mode}: -{c.activations_saved / 1e9:,.3f} GB, +{c.extra_compute:.0%} compute"


def summary(plan: Plan) -> list[str]:
    """The recommendation in words, then the line that runs it; no speed when none is known."""
    head = f"recommended: [bold]{plan.strategy}[/] ({plan.layout}); {plan.reason}"
    if plan.samples_per_s is None or plan.efficiency is None:
        lines = [SPEED_UNKNOWN, f"{head}; memory counted at {plan.precision}"]
    else:
        lines = [
            f"{head}; predicted {plan.samples_per_s:,.1f} samples/s at {plan.precision} "
            f"({plan.samples_per_s / plan.world_size:,.1f} per device), scaling efficiency "
            f"{plan.efficiency:.1%}"
        ]
    return [*lines, f"run it with: {plan.parallel_line}"]


def run(ns: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from manygpu.plan.memory import init_module_note
    from manygpu.plan.recommend import recommend

    cluster = build_cluster(ns)
    # On this CPU machine a real step is the best compute estimate; GPUs use FLOPs at the
    # rate each device reaches in training (plan/devices.py).
    desc = build_desc(ns, measure_step=ns.cluster == "this" and cluster.overlap is False)
    plan = recommend(desc, cluster, batch=ns.batch, precision=ns.precision,
                     optimizer=ns.optimizer, mfu=ns.mfu)  # fmt: skip
    console = Console(soft_wrap=True, width=160)
    console.print(
        f"model: {desc.name}, {desc.parameters / 1e6:,.2f}M parameters; cluster: {cluster.name}"
    )
    acts_known = desc.activation_bytes_per_sample > 0
    console.print(table(plan, acts_known))
    if not acts_known:
        console.print("activations unknown ('?', not counted): give --activation-mb, the "
                      "transformer's --layers/--hidden/--seq, or a --model to measure")  # fmt: skip
    *said, line = summary(plan)
    for text in said:
        console.print(text)
    console.print(escape(line), highlight=False)
    note = init_module_note(desc, cluster.memory_gb, cluster.gpus_per_node)
    if note is not None:
        console.print(escape(note), highlight=False)
    if ns.json:
        data = {"model": asdict(desc), "cluster": asdict(cluster), "plan": _plan_dict(plan)}
        _write_json(Path(ns.json), data)
    return 0


def _write_json(path: Path, data: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str))
    except OSError as exc:
        raise UsageError(
            f"--json {path}: cannot write it ({exc.strerror}); give a writable path"
        ) from None


def _plan_dict(plan: Plan) -> dict[str, Any]:
    out = {k: getattr(plan, k) for k in plan.__dataclass_fields__ if k != "candidates"}
    out["candidates"] = [
        {"strategy": c.strategy, "ways": c.ways, "layout": c.recipe.layout(), "fits": c.fits,
         "memory_bytes": c.memory.total, "prepare_bytes": c.memory.prepare,
         "parallel": c.recipe.parallel_line(),
         "checkpointing": c.recipe.checkpointing, "activations_saved_bytes": c.activations_saved,
         "step_s": c.step.step_s if c.step else None,
         "efficiency": c.step.efficiency if c.step else None}
        for c in plan.candidates
    ]  # fmt: skip
    return out
