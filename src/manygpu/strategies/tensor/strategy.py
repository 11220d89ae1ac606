"""``"tensor"``: each Linear's weight split over the ``tp`` ranks (Megatron-style).

DTensor's ``parallelize_module`` does the work: a *column-parallel* Linear
keeps a slice of the output features, the *row-parallel* one after it a slice
of the input features and all-reduces its output, so a colwise/rowwise pair
(MLP up/down, attention q/k/v then out) costs one all-reduce forward and one
backward. Every tp rank reads the same batch; with ``dp``/``fsdp`` mesh
dimensions the TP-sharded model is also data-parallel (FSDP2 on top: 2-D).

Attention must compute its head count from the tensor (``view(b, t, -1, d)``),
since each rank holds ``heads / tp`` of them, and ``heads`` must divide by tp.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from manygpu.errors import UsageError
from manygpu.strategies.fsdp.sharding import fsdp_kwargs, shard_data_dims
from manygpu.strategies.mesh import job_mesh
from manygpu.strategies.sharded import MeshStrategy
from manygpu.strategies.tensor import Tensor
from manygpu.transforms.materialize import Place

# Leaf names of common layers (Llama, GPT-2/NeoX, BERT-style, torch's MLPs).
# Fused q/k/v projections (c_attn, qkv) are left out on purpose: a colwise
# split of [q; k; v] would give each rank a mix of q, k and v rows.
_COLWISE = {"q_proj", "k_proj", "v_proj", "wq", "wk", "wv", "query", "key", "value",
            "fc1", "w1", "w3", "up_proj", "gate_proj", "c_fc", "fc_in"}  # fmt: skip
_ROWWISE = {"o_proj", "out_proj", "wo", "c_proj", "fc2", "w2", "down_proj", "fc_out"}
# BERT-style encoders name every projection "dense"; the path tells them apart
# (first match wins: the attention's output before the block's output).
_PATH_SUFFIXES = (
    ("attention.output.dense", "rowwise"),
    ("intermediate.dense", "colwise"),
    ("output.dense", "rowwise"),
)
_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


class TensorParallelStrategy(MeshStrategy[Tensor]):
    """Tensor parallelism over ``tp`` (optionally x dp / fsdp)."""

    spec_class = Tensor

    needs_process_group = True
    shards_data = True

    def setup_module(self, module: nn.Module, place: Place) -> nn.Module:
        names = self.mesh_names
        mesh = job_mesh(self.ctx, self.shape, names)
        given = self.options.plan
        plan = resolve_plan(module, given) if given is not None else default_plan(module)
        check_divisible(module, plan, self.shape.tp)
        parallelize_module(module, mesh["tp"], plan)
        if self.data_names:
            fsdp = self.options.fsdp
            kwargs = fsdp_kwargs(fsdp, self.ctx.device, reshard_after_forward=True)
            # Each block its own unit over the data dims (torchtitan's TP then FSDP):
            # one unit for the whole model would gather all of it for the forward.
            shard_data_dims(
                module, mesh[self.data_names], kwargs, children=fsdp.shard_children,
                block_classes=tuple(fsdp.block_classes),  # type: ignore[arg-type]
            )  # fmt: skip
        # Split (and sharded) first, then each rank's slices allocated: the whole
        # model is never on the device. Layers left whole (embeddings, norms) move.
        return place(module, self.ctx.device)


def default_plan(module: nn.Module) -> dict[str, ParallelStyle]:
    """A colwise/rowwise plan from layer names, or Linear-act-Linear in a Sequential."""
    plan: dict[str, ParallelStyle] = {}
    for name, child in module.named_modules():
        style = _named_style(name) if isinstance(child, nn.Linear) else None
        if style is not None:
            plan[name] = _STYLES[style]()
    for name, child in module.named_modules():
        if isinstance(child, nn.Sequential):
            prefix = f"{name}." if name else ""
            for first, second in _linear_pairs(child):
                if f"{prefix}{first}" not in plan and f"{prefix}{second}" not in plan:
                    plan[f"{prefix}{first}"] = ColwiseParallel()
                    plan[f"{prefix}{second}"] = RowwiseParallel()
    if not plan:
        raise UsageError(_no_plan_message(module))
    if not any(isinstance(s, RowwiseParallel) for s in plan.values()):
        raise UsageError(
            "strategy 'tensor' found column-parallel layers but no row-parallel one to "
            "gather their outputs; give strategy=Tensor(plan={'path.to.linear': 'rowwise', ...})"
        )
    return plan


def _named_style(path: str) -> str | None:
    leaf = path.rsplit(".", 1)[-1]
    if leaf in _COLWISE:
        return "colwise"
    if leaf in _ROWWISE:
        return "rowwise"
    return next((style for suffix, style in _PATH_SUFFIXES if path.endswith(suffix)), None)


def _no_plan_message(module: nn.Module) -> str:
    conv1d = sorted({n.rsplit(".", 1)[-1] for n, m in module.named_modules()
                     if type(m).__name__ == "Conv1D"})  # fmt: skip
    if conv1d:
        return (
            f"strategy 'tensor' cannot split GPT-2-style Conv1D projections "
            f"({', '.join(conv1d)}): torch's colwise/rowwise styles split nn.Linear and "
            "c_attn fuses q/k/v; use strategy 'fsdp', or a model with nn.Linear projections"
        )
    return (
        "strategy 'tensor' found no layers to split (no q/k/v/out, fc1/fc2, w1/w2/w3 "
        "Linears, nor Linear-activation-Linear in an nn.Sequential); give "
        "strategy=Tensor(plan={'path.to.linear': 'colwise', ...})"
    )


def _linear_pairs(seq: nn.Sequential) -> list[tuple[str, str]]:
    """(colwise, rowwise) child names: two Linears with only parameter-free layers between."""
    pairs, open_linear = [], None
    for name, layer in seq.named_children():
        if isinstance(layer, nn.Linear):
            if open_linear is None:
                open_linear = name
            else:
                pairs.append((open_linear, name))
                open_linear = None
        elif any(True for _ in layer.parameters()):
            open_linear = None  # a layer with weights between: not a pair
    return pairs


def resolve_plan(module: nn.Module, plan: Mapping[str, Any]) -> dict[str, ParallelStyle]:
    """The user's plan with styles made objects; a missing module is named clearly."""
    names = [n for n, _ in module.named_modules() if n]
    out: dict[str, ParallelStyle] = {}
    for path, style in plan.items():
        if not any(fnmatch.fnmatchcase(n, path) for n in names):
            linears = [n for n, m in module.named_modules() if isinstance(m, nn.Linear)]
            raise UsageError(
                f"tensor plan names {path!r}, which the model does not have; its Linear "
                f"layers are: {', '.join(linears[:12]) or 'none'}"
            )
        out[path] = _style(path, style)
    return out


def _style(path: str, style: Any) -> ParallelStyle:
    if isinstance(style, ParallelStyle):
        return style
    if style in _STYLES:
        return _STYLES[style]()
    raise UsageError(
        f"tensor plan entry {path!r}: unknown style {style!r}; use 'colwise', 'rowwise' "
        "or a torch ParallelStyle"
    )


def check_divisible(module: nn.Module, plan: Mapping[str, ParallelStyle], tp: int) -> None:
    """Each split dimension must divide by tp, or heads and features split unevenly."""
    for name, child in module.named_modules():
        if not isinstance(child, nn.Linear):
            continue
        style = next((s for p, s in plan.items() if fnmatch.fnmatchcase(name, p)), None)
        if isinstance(style, ColwiseParallel):
            dim, size = "out_features", child.out_features
        elif isinstance(style, RowwiseParallel):
            dim, size = "in_features", child.in_features
        else:
            continue
        if size % tp:
            raise UsageError(
                f"cannot split {name!r} over tp={tp}: its {dim} ({size}) is not a "
                "multiple of tp; change tp or the layer size"
            )
