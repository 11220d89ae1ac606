"""What a planned candidate means to run: its sizes in words and its ``Parallel(...)`` line.

The planner counts the memory of one exact configuration (16-bit FSDP2 gathers
under mixed precision, the mesh's sizes, the server count); this module spells
that configuration the way the user writes it, so what was counted is what runs.
Everything strategy-specific comes from the cards (``ways_option``,
``required_options``, ``compute_dtype_option``).
"""

from __future__ import annotations

from dataclasses import dataclass

from manygpu.plan.memory import FP32_BYTES, element_bytes, params_in_compute_dtype
from manygpu.strategies.axes import axis_names, replica_axis
from manygpu.strategies.registry import StrategyCard, card, spec_class

PARALLEL_PRECISION = {"fp32": "fp32-strict", "tf32": "fp32", "bf16": "bf16", "fp16": "fp16"}
"""The planner's precisions as ``Parallel(precision=...)`` spells them: its ``"fp32"``
already runs matmuls in TF32 on a GPU, so the planner's true fp32 is ``"fp32-strict"``."""


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """One candidate: a strategy with its ways on ``world`` devices at ``precision``."""

    strategy: str
    world: int
    ways: int
    """Pipeline / tensor / model ways, or parameter servers (1: none)."""
    precision: str
    """The planner's resolved precision: fp32, tf32, bf16 or fp16."""
    checkpointing: str | None = None
    """Activation checkpointing's mode (``"full"``, ``"selective"``) where the
    candidate fits only with it; ``None``: off."""
    tf32: bool = True
    """Whether the devices have TF32 matmuls (False: a CPU, whose ``precision="fp32"``
    is already strict, so the line says the plain ``"fp32"``)."""

    @property
    def card(self) -> StrategyCard:
        return card(self.strategy)

    @property
    def servers(self) -> int:
        return self.ways if self.card.serves else 0

    @property
    def data_parallel(self) -> int:
        """Model replicas trained side by side (parameter servers' workers included)."""
        c = self.card
        if c.one_process:
            return 1
        if c.serves:
            return self.world - self.ways
        return self.world // self.ways

    @property
    def pipeline_parallel(self) -> int:
        return self.ways if self.card.comm.split == "stages" else 1

    @property
    def tensor_parallel(self) -> int:
        return self.ways if self.card.comm.split == "layer_shards" else 1

    @property
    def low_precision_params(self) -> bool:
        """FSDP2 gathers 16-bit parameters (the card's ``compute_dtype_option`` is set)."""
        return params_in_compute_dtype(self.strategy, self.precision)

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient on the wire: fp32 under autocast (torch keeps fp32
        gradients), 16-bit where FSDP2 reduces in its ``param_dtype``."""
        return element_bytes(self.precision) if self.low_precision_params else FP32_BYTES

    def layout(self) -> str:
        """The sizes in words: ``dp 8``, ``dp 4 x tp 2``, ``2 ps + 6 workers`` (servers)."""
        if self.card.serves:
            return f"{self.servers} ps + {self.data_parallel} workers"
        if self.card.one_process:
            return "1 process" + (f", {self.ways} devices" if self.ways > 1 else "")
        return " x ".join(f"{dim} {size}" for dim, size in self.mesh().items())

    def mesh(self) -> dict[str, int]:
        """Mesh sizes in the mesh's order: the data-parallel replicas (on the replica
        axis), and the ways where the card asks for them on a mesh axis."""
        sizes = {replica_axis(): self.data_parallel}
        ways_axis = self.card.plan_axis()
        if ways_axis is not None:
            sizes[ways_axis] = self.ways
        return {name: sizes[name] for name in axis_names() if name in sizes}

    def parallel_line(self) -> str:
        """The ``Parallel(...)`` call that runs what the planner counted."""
        c = self.card
        options = list(c.required_options)
        if c.ways_option and c.plan_axis() is None:
            options.append(f"{c.ways_option}={self.ways}")
        if self.low_precision_params:
            options.append(f'{c.memory.compute_dtype_option}="{self.precision}"')
        name = spec_class(self.strategy).__name__
        args = [f"strategy={name}({', '.join(options)})" if options else f'strategy="{c.name}"']
        if c.plan_axis() is not None:
            sizes = ", ".join(f'"{dim}": {size}' for dim, size in self.mesh().items())
            args.append(f"mesh={{{sizes}}}")
        strict = self.precision == "fp32" and not self.tf32
        args.append(f'precision="{"fp32" if strict else PARALLEL_PRECISION[self.precision]}"')
        if self.checkpointing is not None:
            args.append(f'activation_checkpointing="{self.checkpointing}"')
        return f"Parallel({', '.join(args)})"
