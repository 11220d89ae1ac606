"""Carry every rank's step split to the main rank and say who is slow (on by default).

Each rank's :class:`~manygpu.observe.step_clock.StepClock` hands its window to a
daemon thread, which writes it under a key of the job's c10d store — not a
collective: nothing is added to the training stream, no sequence number of a
hang verdict moves, and a rank that is late simply reports late. One rank per
host also times a 1 MiB round trip to the store, its link's measure. The main
rank's thread reads a window once every rank's key is there, deletes the keys,
and asks :class:`~manygpu.observe.straggler_rules.Judge`, printing each verdict
once as ``manygpu: straggler: ...``.

Anything the store refuses (the job ending, the store's host gone) quietly ends
the reports: they are advice, never a reason for a job to fail.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from manygpu.observe.step_clock import DEFAULT_EVERY, StepClock, StepSplit
from manygpu.observe.straggler_rules import Judge
from manygpu.runtime import env as envmod

LINK_PAYLOAD = b"\0" * (1 << 20)
"""What one rank per host sends through the store and reads back, once per window:
a bandwidth, not a latency, measure (a 64 KiB probe fits in the burst a switch
buffer or a token bucket passes at line rate, and showed a 100 Mbit/s link as
fast as the 1 Gbit/s ones)."""
KEEP_WINDOWS = 4
"""Windows the main rank waits for late ranks before giving a window up."""
CLOSE_WAIT_S = 1.5
"""How long the main rank's close waits for the other ranks' last windows."""


class Board:
    """This rank's sender; on the main rank also the collector and the judge."""

    def __init__(
        self,
        store: Any,
        prefix: str,
        rank: int,
        world: int,
        *,
        probes_link: bool,
        say: Callable[[str], None] | None,
    ) -> None:
        self._store, self._prefix, self._rank, self._world = store, prefix, rank, world
        self._probes_link, self._say = probes_link, say
        self._judge = Judge()
        self._pending: list[int] = []
        self.latest: list[StepSplit] = []
        """The last complete window of every rank (main rank only)."""
        self._queue: queue.SimpleQueue[StepSplit | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="manygpu-steps", daemon=True)
        self._thread.start()

    def post(self, split: StepSplit) -> None:
        """Called on the training thread: the rest happens on the board's."""
        self._queue.put(split)

    def close(self, timeout_s: float = CLOSE_WAIT_S + 1.0) -> None:
        """Send what is queued, judge what is complete, and stop."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _key(self, window: int, rank: int) -> str:
        return f"{self._prefix}/{window}/{rank}"

    def _run(self) -> None:
        try:
            while (split := self._queue.get()) is not None:
                if self._probes_link:
                    split = replace(split, link_ms=self._link_ms())
                self._store.set(self._key(split.window, self._rank), json.dumps(asdict(split)))
                if self._say is not None:
                    self._pending.append(split.window)
                    self._collect()
            # Closing: the others' last windows are on their way (they end together).
            deadline = time.monotonic() + CLOSE_WAIT_S
            while self._pending and time.monotonic() < deadline:
                time.sleep(0.05)
                self._collect()
        except Exception:  # the store is gone: the job is ending
            return

    def _link_ms(self) -> float:
        key = f"{self._prefix}/link/{self._rank}"
        start = time.perf_counter()
        self._store.set(key, LINK_PAYLOAD)
        self._store.get(key)
        elapsed = time.perf_counter() - start
        self._store.delete_key(key)
        return round(elapsed * 1e3, 3)

    def _collect(self) -> None:
        for window in list(self._pending):
            keys = [self._key(window, r) for r in range(self._world)]
            if not self._store.check(keys):
                if window < self._pending[-1] - KEEP_WINDOWS:
                    self._pending.remove(window)  # a rank stopped reporting: give it up
                continue
            splits = [StepSplit(**json.loads(v)) for v in self._store.multi_get(keys)]
            for key in keys:
                self._store.delete_key(key)
            self._pending.remove(window)
            self.latest = splits
            assert self._say is not None
            for line in self._judge.window(splits):
                self._say(f"manygpu: straggler: {line}")


def steps_every(configured: bool | int, env: envmod.Environ) -> int | None:
    """Steps per report, ``None`` when off (``stragglers=False`` or ``MANYGPU_STRAGGLERS=0``)."""
    if configured is False:
        return None
    from_env = envmod.straggler_every(env)
    if from_env == 0:
        return None
    if configured is not True:
        return int(configured)
    return from_env or DEFAULT_EVERY


class StepReports:
    """What :class:`~manygpu.Parallel` holds: this rank's clock and board."""

    def __init__(self, clock: StepClock, board: Board) -> None:
        self.clock, self.board = clock, board
        self._shown: int | None = None

    def table(self) -> list[dict[str, Any]]:
        """Every rank's latest window (main rank; empty elsewhere and before the first)."""
        return [asdict(s) for s in self.board.latest]

    def new_table(self) -> list[dict[str, Any]]:
        """:meth:`table` when its window was not shown yet, else empty (shown once each)."""
        rows = self.table()
        if not rows or rows[0]["window"] == self._shown:
            return []
        self._shown = rows[0]["window"]
        return rows

    def close(self) -> None:
        self.board.close()


def start(
    every: int | None, rank: int, world: int, *, local_rank: int, peers: int, is_main: bool
) -> StepReports | None:
    """This rank's step reports, ``None`` when off or alone."""
    dist = sys.modules.get("torch.distributed")
    if every is None or world < 2 or dist is None or not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    env = envmod.current()
    host = envmod.host_name(env)
    prefix = f"manygpu/steps/{envmod.restart_count(env)}"
    board = Board(
        _get_default_store(),
        prefix,
        rank,
        world,
        probes_link=local_rank == 0,
        say=_say if is_main else None,
    )
    return StepReports(StepClock(every, rank, host, peers, board.post), board)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


_COLUMNS = (
    ("rank", "rank"),
    ("host", "host"),
    ("step ms", "step_ms"),
    ("input ms", "input_ms"),
    ("compute ms", "compute_ms"),
    ("exposed comm ms", "comm_ms"),
    ("link ms", "link_ms"),
)


NOTE = (
    "each column is the median over the steps of its own figure, so the parts need not "
    "add up to the step: rest ms is the step less its parts (below 0 where they sum past it); "
    "link ms: one rank per host times its host's round trip to the job's store, "
    "- for that host's other ranks"
)
"""Said under the table, so a row that does not add up or a ``-`` is not read as a bug."""


def rest_ms(row: dict[str, Any]) -> float:
    """The step's median less its parts' medians (exposed comm counted as 0 where the
    strategy cannot tell it apart from compute)."""
    parts = row["input_ms"] + row["compute_ms"] + (row["comm_ms"] or 0.0)
    return float(row["step_ms"] - parts)


def render(rows: list[dict[str, Any]]) -> Any:
    """The per-rank table of :attr:`~manygpu.Parallel.step_times`, for the console."""
    from rich.table import Table

    table = Table(title=f"step times per rank (median of {rows[0]['steps']} steps)", caption=NOTE)
    titles = [title for title, _ in _COLUMNS]
    titles.insert(-1, "rest ms")  # beside the parts it completes, before link ms
    for title in titles:
        table.add_column(title, justify="left" if title == "host" else "right")
    for row in sorted(rows, key=lambda r: r["rank"]):
        cells = [_cell(row[k]) for _, k in _COLUMNS]
        cells.insert(-1, _cell(rest_ms(row)))
        table.add_row(*cells)
    return table


def _cell(value: object) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)
