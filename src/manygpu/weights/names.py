"""Which stored tensor fills which of a model's tensors: ``load_state_dict``'s rules.

- Names are state-dict names: parameters and persistent buffers (non-persistent
  buffers are not expected), as ``model.state_dict()`` spells them.
- A tensor reachable under several names (tied weights) is one tensor: any of
  its names in the file fills it, once. Hugging Face files drop the tied
  ``lm_head.weight``; ``transformers`` re-ties it.
- Hugging Face's base-model prefix, as ``transformers`` handles it key by key: a
  model with ``base_model_prefix = "model"`` takes ``model.layers.0...`` into its
  ``layers.0...`` (a base model from a head model's file: the head's own tensors,
  outside the prefix, are then not for it), and ``layers.0...`` into
  ``model.layers.0...`` (a head model from a base model's file).
- A pipeline stage holds some of the model: ``expected`` lists the whole model's
  names (tied ones grouped, :func:`state_names`) so that missing and unexpected
  keys are judged against the whole model, the same way on every rank.

Every error is one line decided from the file's header and the names alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from manygpu.errors import CheckpointError
from manygpu.weights.st_file import Spec

Expected = Iterable[str | Sequence[str]]
"""The whole model's state-dict names; a sequence of names is one tensor (tied)."""

SHOWN = 3
"""How many names an error lists before "and N more"."""


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every state-dict name of ``model`` and its tensor (the parameter itself, so tied
    names share one object); non-tensor extra state is left out."""
    state = model.state_dict(keep_vars=True)
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def state_names(model: nn.Module) -> list[tuple[str, ...]]:
    """``model``'s state-dict names, tied names grouped, in state-dict order.

    Give it the whole model (on the meta device, say) and pass the result as
    ``expected`` when loading into one pipeline stage of it.
    """
    groups: dict[int, list[str]] = {}
    for name, tensor in model_tensors(model).items():
        groups.setdefault(id(tensor), []).append(name)
    return [tuple(names) for names in groups.values()]


@dataclass
class _Groups:
    """Names joined into tied groups (union-find); each group's order kept."""

    parent: dict[str, str] = field(default_factory=dict)

    def find(self, name: str) -> str:
        self.parent.setdefault(name, name)
        while self.parent[name] != name:
            self.parent[name] = self.parent[self.parent[name]]
            name = self.parent[name]
        return name

    def join(self, names: Sequence[str]) -> None:
        roots = [self.find(n) for n in names]
        for root in roots[1:]:
            self.parent[root] = roots[0]

    def groups(self) -> list[list[str]]:
        out: dict[str, list[str]] = {}
        for name in self.parent:
            out.setdefault(self.find(name), []).append(name)
        return list(out.values())


def _few(names: Sequence[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown + (f" (and {len(names) - SHOWN} more)" if len(names) > SHOWN else "")


def _patterns(model: nn.Module, attribute: str) -> list[re.Pattern[str]]:
    """A Hugging Face model's ``_keys_to_ignore_on_load_*`` regexes (none otherwise)."""
    found = getattr(model, attribute, None) or []
    return [re.compile(p) for p in found if isinstance(p, str)]


def _rename(keys: Iterable[str], names: set[str], prefix: str) -> tuple[dict[str, str], list[str]]:
    """``model name -> file key`` for the keys that fit a name, and the keys that fit none."""
    present: dict[str, str] = {}
    rest: list[str] = []
    keys = list(keys)
    for key in keys:  # exact names first: they win over a prefixed twin
        if key in names:
            present[key] = key
    dot = f"{prefix}." if prefix else ""
    for key in keys:
        if key in names:
            continue
        if dot and key.startswith(dot) and key[len(dot) :] in names:
            present.setdefault(key[len(dot) :], key)
        elif dot and dot + key in names:
            present.setdefault(dot + key, key)
        else:
            rest.append(key)
    stripped = any(key != name and key == dot + name for name, key in present.items())
    if stripped:  # a head model's file into its base model: the head's tensors are not ours
        rest = [key for key in rest if key.startswith(dot)]
    return present, rest


def match(
    model: nn.Module, entries: Mapping[str, Spec], where: str, expected: Expected | None = None
) -> list[tuple[str, torch.Tensor]]:
    """``(file key, tensor)`` for each of ``model``'s tensors, each tensor once.

    Raises:
        CheckpointError: keys missing or unexpected (the same on every rank: the
            file and the names decide), or a stored shape that is not the
            tensor's (global) shape.
    """
    own = model_tensors(model)
    tied = _Groups()
    for names in state_names(model):
        tied.join(names)
    for item in expected or ():
        tied.join([item] if isinstance(item, str) else list(item))
    groups = tied.groups()
    prefix = getattr(model, "base_model_prefix", "")
    prefix = prefix if isinstance(prefix, str) else ""
    present, unexpected = _rename(entries, set(tied.parent), prefix)
    skip_missing = _patterns(model, "_keys_to_ignore_on_load_missing")
    skip_unexpected = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    missing = [g[0] for g in groups if not any(n in present for n in g)]
    missing = [n for n in missing if not any(p.search(n) for p in skip_missing)]
    unexpected = [k for k in unexpected if not any(p.search(k) for p in skip_unexpected)]
    _check_keys(where, missing, unexpected)
    group_of = {name: g for g in groups for name in g}
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for name, tensor in own.items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        found = [present[n] for n in [name, *group_of[name]] if n in present]
        if found:  # else ignored as missing by the model's own rule
            out.append((found[0], tensor))
    _check_shapes(where, out, entries)
    return out


def _check_keys(where: str, missing: Sequence[str], unexpected: Sequence[str]) -> None:
    parts = []
    if missing:
        parts.append(f"lacks {len(missing)} of the model's tensors ({_few(missing)})")
    if unexpected:
        parts.append(f"holds {len(unexpected)} the model has no place for ({_few(unexpected)})")
    if parts:
        raise CheckpointError(
            f"weights {where} do not fit this model: it {' and '.join(parts)}; load the weights "
            "this model was built for, or build the model that matches them"
        )


def _check_shapes(
    where: str, pairs: Sequence[tuple[str, torch.Tensor]], entries: Mapping[str, Spec]
) -> None:
    wrong = [
        (key, entries[key].shape, tuple(tensor.shape))
        for key, tensor in pairs
        if entries[key].shape != tuple(tensor.shape)
    ]
    if wrong:
        key, stored, model = wrong[0]
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise CheckpointError(
            f"weights {where} do not fit this model: {key} is {list(stored)} in the file but "
            f"{list(model)} in the model{more}; build the model with the configuration the "
            "weights were saved from"
        )
