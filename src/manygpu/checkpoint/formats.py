"""How model and optimizer state reach disk: one full copy, or DCP shards.

- ``full``: the main rank writes the whole (unwrapped) model and optimizer
  state with ``torch.save``; right for replicated strategies (single, dp, ddp),
  where every rank holds the same state. Loads on any number of ranks.
- ``dcp``: ``torch.distributed.checkpoint``: every rank writes its shards in
  parallel, and a load on another world size reshards. Needed for sharded
  strategies; works for replicated ones too.

Both load without running code from the checkpoint: ``weights_only=True``
for our files, and :mod:`.safe_dcp` for DCP's metadata and non-tensor items.
Which format a directory holds is decided by its files (:func:`detect`), never
by a field of ``meta.json`` that anyone can edit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from manygpu.checkpoint.layout import CheckpointError
from manygpu.checkpoint.safe_dcp import safe_load

MODEL, OPTIM, EXTRAS, SHARDS = "model.pt", "optim.pt", "extras.pt", "shards"


@dataclass
class Parts:
    """What a checkpoint holds besides counters and RNGs."""

    model: nn.Module
    """The user's (unwrapped) module."""
    wrapped: nn.Module
    """The module as the strategy wrapped it (DCP reads sharding from it)."""
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    scaler: torch.amp.GradScaler | None = None

    def extras(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        return out

    def load_extras(self, extras: dict[str, Any]) -> None:
        if self.scheduler is not None and "scheduler" in extras:
            self.scheduler.load_state_dict(extras["scheduler"])
        if self.scaler is not None and "scaler" in extras:
            self.scaler.load_state_dict(extras["scaler"])


def to_cpu_copy(tree: Any) -> Any:
    """A snapshot of a state dict, safe to write while training goes on."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: to_cpu_copy(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(to_cpu_copy(v) for v in tree)
    return tree


def full_snapshot(parts: Parts, *, copy: bool) -> dict[str, Any]:
    """Main rank's files for the ``full`` format.

    ``copy=True`` snapshots to CPU (needed when training goes on while the
    files are written); a blocking save writes the live tensors instead.
    """
    files = {MODEL: parts.model.state_dict(), EXTRAS: parts.extras()}
    if parts.optimizer is not None:
        files[OPTIM] = parts.optimizer.state_dict()
    return {name: to_cpu_copy(state) for name, state in files.items()} if copy else files


def detect(directory: Path) -> str:
    """``"full"`` or ``"dcp"``, from the files the directory holds (exactly one kind)."""
    full = (directory / MODEL).is_file()
    dcp_meta = (directory / SHARDS / ".metadata").is_file()
    if full and not (directory / SHARDS).exists():
        return "full"
    if dcp_meta and not full:
        return "dcp"
    what = "both model.pt and shards/" if full else "neither model.pt nor shards/.metadata"
    raise CheckpointError(f"checkpoint {directory} holds {what}; it is not a checkpoint we wrote")


def write_files(directory: Path, files: dict[str, Any]) -> None:
    for name, state in files.items():
        torch.save(state, directory / name)


def _load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except Exception as exc:  # unpickling errors come in many types
        raise CheckpointError(f"checkpoint file {path} cannot be read: {exc}") from None


def _fit(directory: Path, load: Any) -> None:
    """Run ``load``; a state that does not fit the model is one line naming the first misfit."""
    try:
        load()
    except RuntimeError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        misfit = next((ln for ln in lines[1:] if ln), lines[0] if lines else "")
        raise CheckpointError(
            f"checkpoint {directory} does not fit this model ({misfit[:240]}); "
            "build the model the way it was when the checkpoint was saved"
        ) from None


def read_full(directory: Path, parts: Parts) -> None:
    """Load a ``full`` checkpoint into ``parts`` (any world size)."""
    _fit(directory, lambda: parts.model.load_state_dict(_load(directory / MODEL)))
    if parts.optimizer is not None:
        if not (directory / OPTIM).is_file():
            raise CheckpointError(f"checkpoint {directory} holds no optimizer state")
        parts.optimizer.load_state_dict(_load(directory / OPTIM))
    parts.load_extras(_load(directory / EXTRAS))


def _dcp_state(parts: Parts) -> dict[str, Any]:
    optimizers = [parts.optimizer] if parts.optimizer is not None else []
    model_sd, optim_sd = get_state_dict(parts.wrapped, optimizers)
    state: dict[str, Any] = {"model": model_sd}
    if optimizers:
        state["optim"] = optim_sd
    return state


def write_dcp(directory: Path, parts: Parts, group: Any = None) -> None:
    """Every rank writes its shards into ``directory/shards`` (collective over ``group``)."""
    dcp.save(
        _dcp_state(parts),
        checkpoint_id=str(directory / SHARDS),
        process_group=group,
        no_dist=not dist.is_initialized(),
    )
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(to_cpu_copy(parts.extras()), directory / EXTRAS)


def read_dcp(directory: Path, parts: Parts, group: Any = None) -> None:
    """Load DCP shards into ``parts``, resharding to this world size (collective)."""
    state = _dcp_state(parts)
    safe_load(
        state,
        str(directory / SHARDS),
        process_group=group,
        no_dist=not dist.is_initialized(),
    )
    optimizers = [parts.optimizer] if parts.optimizer is not None else []
    set_state_dict(
        parts.wrapped,
        optimizers,
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )
    parts.load_extras(_load(directory / EXTRAS))
