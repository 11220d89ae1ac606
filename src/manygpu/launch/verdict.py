"""From what every rank was doing when the job stopped moving, one line: who, where, why.

Pure functions over plain data (:class:`RankView`), so every rule is tested
with lists of views. The views come from each host's launcher
(:mod:`manygpu.launch.hangwatch`): a rank's own answer (its stacks, the Flight
Recorder's records), or what the launcher could see of it when it could not
answer (stopped, exited, silent in native code).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from manygpu.runtime.ranks import ranks_text

STATES = ("answered", "stopped", "silent", "exited")


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective as the Flight Recorder saw it on one rank."""

    pg: str
    seq: int
    op: str = "collective"
    """``all_reduce``, ``broadcast``, ``barrier``... (without the backend's prefix)."""
    args: str = ""
    """``float32[1024]``: the tensors it was called with."""

    @property
    def name(self) -> str:
        return f"{self.op} #{self.seq}" + ("" if self.pg in ("0", "") else f" (group {self.pg})")


@dataclass(frozen=True, kw_only=True)
class RankView:
    """What one rank was doing."""

    rank: int
    host: str
    state: str = "answered"
    """``answered``; ``stopped`` (SIGSTOP, a debugger); ``silent`` (alive but its
    threads could not answer: native code holding the GIL); ``exited``."""
    waiting: Collective | None = None
    """The collective it waits in, ``None`` when it is in none."""
    where: str = ""
    """Its own code's innermost frame, ``train.py:57 in save_checkpoint()``."""
    detail: str = ""
    """More on where it is (``in the DataLoader (worker 1 at dataset.py:40)``, an exit code)."""
    evidence: str = ""
    """The file holding its stacks and records."""
    extra: dict[str, str] = field(default_factory=dict)


def _who(v: RankView) -> str:
    return f"rank {v.rank} (host {v.host})"


def _state(v: RankView) -> str:
    """Where a rank that is not in the collective is, in words."""
    at = f" at {v.where}" if v.where else ""
    if v.state == "stopped":
        return f"rank {v.rank} is stopped (SIGSTOP or a debugger){at}"
    if v.state == "exited":
        return f"rank {v.rank} has exited{f' ({v.detail})' if v.detail else ''}"
    if v.state == "silent":
        return f"rank {v.rank} does not answer: it is in native code holding the GIL{at}"
    detail = f", {v.detail}" if v.detail else ""
    return f"rank {v.rank} is{at or ' in its own code'}{detail}"


def compose(views: list[RankView], world: int) -> tuple[str, int]:
    """The verdict line (without ``manygpu: hang:``) and the rank to blame."""
    waiting = [v for v in views if v.waiting is not None]
    missing = sorted(set(range(world)) - {v.rank for v in views})
    if not waiting:
        return "no rank waits in a collective; nothing to blame", min(v.rank for v in views)
    counts = Counter((v.waiting.pg, v.waiting.seq) for v in waiting if v.waiting)
    main_key = max(counts, key=lambda k: (counts[k], k[1]))
    in_main = [v for v in waiting if v.waiting and (v.waiting.pg, v.waiting.seq) == main_key]
    name = in_main[0].waiting.name if in_main[0].waiting else ""
    others = [v for v in views if v not in in_main]
    wait_text = f"{ranks_text([v.rank for v in in_main])} wait in"
    if len(in_main) == 1:
        wait_text = f"rank {in_main[0].rank} waits in"
    if others or missing:
        return _absent(others, missing, name, wait_text)
    return _mismatch(in_main, name)


def behind(views: list[RankView]) -> list[int]:
    """Ranks whose open collective another rank of its group has already finished.

    A rank waits in #N of a group while another waits in #M > N of the same group:
    that other rank finished #N, which every rank of the group takes part in, so
    the first rank's answer was most likely read before its Flight Recorder
    counted #N's end (under load, a rank's threads can lag its peers' by seconds).
    Blamed on that answer, a healthy rank would be named ("rank 0 waits in
    all_reduce #9 while ranks 1-3 wait in all_reduce #10") instead of the one
    that called something else: the launcher asks such ranks again first.
    """
    newest: dict[str, int] = {}
    for v in views:
        if v.waiting is not None:
            newest[v.waiting.pg] = max(newest.get(v.waiting.pg, -1), v.waiting.seq)
    return sorted(
        v.rank for v in views if v.waiting is not None and v.waiting.seq < newest[v.waiting.pg]
    )


def _absent(
    others: list[RankView], missing: list[int], name: str, wait_text: str
) -> tuple[str, int]:
    """Some ranks are not in the collective the others wait in."""
    culprits = sorted(others, key=lambda v: (v.waiting is not None, v.rank))
    if culprits:
        first = culprits[0]
        if first.waiting is not None:
            line = f"{_who(first)} waits in {first.waiting.name} while {wait_text} {name}"
            line += f", called at {first.where}" if first.where else ""
        else:
            line = f"{_who(first)} never entered {name} that {wait_text}; {_state(first)}"
        rest = [v.rank for v in culprits[1:]] + missing
        if rest:
            line += f" (also not in it: {ranks_text(rest)})"
        return line, first.rank
    line = f"{ranks_text(missing)} never answered"
    return f"{line}; {wait_text} {name}", missing[0]


DEBUG_CHECK = "debug_check"
"""A view's ``extra`` key: the rank waits in ``MANYGPU_DEBUG``'s own check of its call."""


def _mismatch(in_main: list[RankView], name: str) -> tuple[str, int]:
    """Every rank is in the same collective: do they agree on what it is?"""
    # Counted in rank order, so a tie names the same majority whatever order views came in.
    ordered = sorted(in_main, key=lambda v: v.rank)
    checking = [v for v in ordered if v.extra.get(DEBUG_CHECK)]
    if checking and len(checking) < len(ordered):
        return _checked_alone(checking, [v for v in ordered if v not in checking], name)
    kinds = Counter((v.waiting.op, v.waiting.args) for v in ordered if v.waiting)
    if len(kinds) == 1:
        rank = min(v.rank for v in in_main)
        return (
            f"all ranks wait in {name} with the same arguments: no rank is missing, "
            "so a connection between them is stuck (network, or a peer's backend thread)",
            rank,
        )
    common = kinds.most_common(1)[0][0]
    # The odd ranks, grouped by what they called (several groups when they disagree too).
    groups: dict[tuple[str, str], list[RankView]] = {}
    for v in ordered:
        if v.waiting and (v.waiting.op, v.waiting.args) != common:
            groups.setdefault((v.waiting.op, v.waiting.args), []).append(v)
    said = [
        f"{_group(group)} {'started it ' if i == 0 else ''}as {op}({args})"
        for i, ((op, args), group) in enumerate(groups.items())
    ]
    first = next(iter(groups.values()))[0]
    number = name.split(" ", 1)[1] if " " in name else name
    line = (
        f"all ranks wait in collective {number}; {', '.join(said)}, "
        f"the others as {common[0]}({common[1]})"
    )
    line += f"; rank {first.rank} is at {first.where}" if first.where else ""
    return line, first.rank


def _checked_alone(checking: list[RankView], others: list[RankView], name: str) -> tuple[str, int]:
    """Some ranks wait in ``MANYGPU_DEBUG``'s check of a collective (which the check's
    own all-gather stands for), the others in a collective of the framework's (DDP's
    broadcast or all-reduce: never checked): the checked ranks called one the others do
    not reach. Their call site is the user's line; the check's all-gather is no cause."""
    number = name.split(" ", 1)[1] if " " in name else name
    first = checking[0]
    where = f" at {first.where}" if first.where else ""
    said = [
        f"rank {v.rank} is in {v.waiting.op}({v.waiting.args})"
        + (f" at {v.where}" if v.where else "")
        for v in others
        if v.waiting
    ]
    verb = "calls" if len(checking) == 1 else "call"
    line = (
        f"{_group(checking)} {verb} a collective{where} that "
        f"{ranks_text([v.rank for v in others])} never reach{'es' * (len(others) == 1)} "
        f"(collective {number}: "
        f"{'; '.join(said)}); a collective only some ranks call (under `if rank == 0:`?) "
        "waits forever: call it on every rank"
    )
    return line, first.rank


def _group(views: list[RankView]) -> str:
    """``rank 3 (host a)``, ``ranks 2, 3 (host a)``, ``ranks 2-4 (hosts a,b)``."""
    hosts = sorted({v.host for v in views})
    return (
        f"{ranks_text([v.rank for v in views])} "
        f"(host{'s' if len(hosts) > 1 else ''} {','.join(hosts)})"
    )


# -- reading a rank's frames ----------------------------------------------------------

_LIBRARY_MARKERS = (
    f"{os.sep}site-packages{os.sep}",
    f"{os.sep}dist-packages{os.sep}",
    # manygpu itself, by its real directory: a checkout named manygpu (CI clones are)
    # must not make the user's scripts inside it look like library code.
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    f"{os.sep}lib{os.sep}python3",
    "<frozen ",
)


def own_frame(stack: list[list[object]], *, own_only: bool = False) -> str:
    """The innermost frame of the user's own code in ``stack`` (innermost last).

    Without one: the innermost frame of all, or ``""`` with ``own_only``.
    """
    for filename, line, func in reversed([(str(f[0]), f[1], str(f[2])) for f in stack]):
        if not any(marker in filename for marker in _LIBRARY_MARKERS):
            func_text = f" in {func}()" if func != "<module>" else ""
            return f"{os.path.basename(filename)}:{line}{func_text}"
    if stack and not own_only:
        last = stack[-1]
        return f"{os.path.basename(str(last[0]))}:{last[1]} in {last[2]}()"
    return ""


def in_debug_check(stack: list[list[object]]) -> bool:
    """Whether a stack waits in ``MANYGPU_DEBUG``'s check before a collective."""
    check = os.path.join("manygpu", "comm", "debug.py")
    return any(str(f[0]).endswith(check) for f in stack)


def in_dataloader(stack: list[list[object]]) -> bool:
    """Whether a stack waits inside torch's DataLoader."""
    return any("torch/utils/data/" in str(f[0]) for f in stack)


def parse_faulthandler(text: str) -> list[list[list[object]]]:
    """faulthandler's dump -> one stack per thread (innermost last), in the dump's order.

    faulthandler lists the newest thread first, so the main thread is the last.
    """
    stacks: list[list[list[object]]] = []
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            stacks.append([])
        elif stacks and line.strip().startswith('File "'):
            head, _, func = line.strip().partition(" in ")
            name, _, lineno = head.removeprefix('File "').partition('", line ')
            digits = "".join(ch for ch in lineno if ch.isdigit())
            stacks[-1].insert(0, [name, int(digits or 0), func])
    return stacks
