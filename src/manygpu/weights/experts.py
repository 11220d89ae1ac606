"""Hugging Face MoE files keep each expert apart; transformers 5's models stack them.

A Mixtral file on the Hub (and what ``save_pretrained`` still writes) holds
``model.layers.0.block_sparse_moe.experts.3.w1.weight`` ([ffn, hidden]) per
expert, with ``w1`` / ``w3`` / ``w2`` the gate, up and down projections; a
Qwen2-MoE / Qwen3-MoE / DeepSeek-style file holds ``mlp.experts.3.gate_proj``,
``up_proj`` and ``down_proj``. The model (``MixtralExperts``, ``Qwen2MoeExperts``)
holds two stacked parameters per layer, as transformers' own load converts
them: ``mlp.experts.gate_up_proj`` = ``[E, 2 * ffn, hidden]`` (each expert's gate
rows, then its up rows) and ``mlp.experts.down_proj`` = ``[E, hidden, ffn]``; and
Mixtral's ``block_sparse_moe.gate`` is the model's ``mlp.gate``.

:func:`stack_experts` shows such a file under the model's names: a stacked
name's block is read from the experts it covers alone, so a rank holding
experts ``[2, 4)`` (expert parallelism's ``Shard(0)``) reads only their rows.
Nothing changes when the model's names are the file's own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from manygpu.weights.sources import SlicedSource
from manygpu.weights.st_file import Spec

_PER_EXPERT = re.compile(
    r"^(?P<pre>.*)\.(?P<block>block_sparse_moe|mlp)\.experts\.(?P<e>\d+)\."
    r"(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_ROLE = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": 2, "down_proj": 2}
"""Which stacked piece a per-expert projection is: gate, up (both ``gate_up_proj``), down."""
_LEGACY_BLOCK = ".block_sparse_moe."


@dataclass(frozen=True)
class _Stack:
    """One stacked parameter: for each expert, the file keys its rows come from, in order."""

    keys: tuple[tuple[str, ...], ...]
    rows: tuple[int, ...]
    """Rows each key gives (gate then up for ``gate_up_proj``; down alone)."""
    spec: Spec


class StackedExperts(SlicedSource):
    """``inner`` under the model's names: per-expert tensors read as stacks, renamed blocks."""

    def __init__(
        self, inner: SlicedSource, stacks: dict[str, _Stack], renamed: dict[str, str]
    ) -> None:
        self.inner, self.stacks, self.renamed = inner, stacks, renamed
        self.where = inner.where
        used = {k for s in stacks.values() for per in s.keys for k in per} | set(renamed.values())
        self.entries = {k: v for k, v in inner.entries.items() if k not in used}
        self.entries.update({new: inner.entries[old] for new, old in renamed.items()})
        self.entries.update({name: s.spec for name, s in stacks.items()})

    def read(self, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        if name in self.renamed:
            return self.inner.read(self.renamed[name], index)
        stack = self.stacks.get(name)
        if stack is None:
            return self.inner.read(name, index)
        full = tuple(slice(0, n) for n in stack.spec.shape)
        experts, rows, cols = index if index is not None else full
        chosen = range(*experts.indices(len(stack.keys)))
        if not chosen:  # callers skip empty blocks; kept whole for the odd one
            picked = zip((experts, rows, cols), stack.spec.shape, strict=True)
            size = [len(range(*s.indices(n))) for s, n in picked]
            return torch.empty(size, dtype=stack.spec.dtype)
        return torch.stack([self._rows(stack, e, rows, cols) for e in chosen])

    def _rows(self, stack: _Stack, expert: int, rows: slice, cols: slice) -> torch.Tensor:
        """Rows ``rows`` of expert ``expert``'s stacked matrix, from its pieces' keys."""
        start, stop, _ = rows.indices(sum(stack.rows))
        parts, offset = [], 0
        for key, count in zip(stack.keys[expert], stack.rows, strict=True):
            lo, hi = max(start, offset), min(stop, offset + count)
            if lo < hi:
                parts.append(self.inner.read(key, (slice(lo - offset, hi - offset), cols)))
            offset += count
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def close(self) -> None:
        self.inner.close()


def stack_experts(source: SlicedSource, names: Iterable[str]) -> SlicedSource:
    """``source`` seen under the model's ``names`` where its experts are stored apart
    (see the module docstring); ``source`` itself when there is nothing to convert."""
    wanted = set(names)
    per: dict[tuple[str, str], dict[int, dict[int, str]]] = {}
    for key in source.entries:
        found = _PER_EXPERT.match(key)
        if found is not None and key not in wanted:
            where = (found["pre"], found["block"])
            per.setdefault(where, {}).setdefault(int(found["e"]), {})[_ROLE[found["proj"]]] = key
    stacks: dict[str, _Stack] = {}
    for (pre, _), experts in per.items():
        base = f"{pre}.mlp.experts"
        if f"{base}.gate_up_proj" not in wanted or sorted(experts) != list(range(len(experts))):
            continue
        roles = [experts[e] for e in range(len(experts))]
        if any(sorted(r) != [0, 1, 2] for r in roles):
            continue
        gate_up = _stack(source, [(r[0], r[1]) for r in roles])
        down = _stack(source, [(r[2],) for r in roles])
        if gate_up is not None and down is not None:  # else: the keys stay, named unexpected
            stacks[f"{base}.gate_up_proj"], stacks[f"{base}.down_proj"] = gate_up, down
    renamed = {
        key.replace(_LEGACY_BLOCK, ".mlp."): key
        for key in source.entries
        if _LEGACY_BLOCK in key and key not in wanted and _PER_EXPERT.match(key) is None
        and key.replace(_LEGACY_BLOCK, ".mlp.") in wanted
    }  # fmt: skip
    if not stacks and not renamed:
        return source
    return StackedExperts(source, stacks, renamed)


def _stack(source: SlicedSource, keys: Sequence[tuple[str, ...]]) -> _Stack | None:
    """The stacked parameter's spec: experts x (the pieces' rows summed) x columns;
    ``None`` when the experts' pieces differ in shape or dtype (not one stack)."""
    first = [source.entries[k] for k in keys[0]]
    if any([source.entries[k] for k in per] != first for per in keys):
        return None
    if any(len(s.shape) != 2 or s.shape[1] != first[0].shape[1] for s in first):
        return None
    rows = tuple(s.shape[0] for s in first)
    shape = (len(keys), sum(rows), first[0].shape[1])
    return _Stack(keys=tuple(keys), rows=rows, spec=Spec(shape=shape, dtype=first[0].dtype))
