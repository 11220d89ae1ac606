"""Main-process-only printing and progress bars (one helper, as nanoGPT's master flag)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

T = TypeVar("T")


class MainConsole:
    """Prints and shows progress on the main process; silent elsewhere."""

    def __init__(self, is_main: bool, rank: int) -> None:
        self.is_main = is_main
        self.rank = rank
        self._live: tuple[Progress, TaskID] | None = None
        self._status = ""
        self._note = ""

    @cached_property
    def _console(self) -> Console:
        """rich, loaded when something is first printed (not by ``import manygpu``)."""
        from rich.console import Console

        return Console(file=sys.stdout, highlight=False, soft_wrap=True)

    def print(self, *objects: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main:
            self._console.print(*objects, **kwargs)

    def progress(
        self, items: Iterable[T], description: str = "", total: int | None = None
    ) -> Iterator[T]:
        """Iterate ``items`` with a progress bar on the main process (when a terminal)."""
        if not self.is_main or not self._console.is_terminal:
            yield from items
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        if total is None and hasattr(items, "__len__"):
            total = len(items)  # type: ignore[arg-type]
        columns = (
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
        )
        with Progress(*columns, console=self._console, transient=True) as bar:
            task = bar.add_task(description, total=total, status="")
            self._live = (bar, task)
            try:
                for item in items:
                    yield item
                    bar.advance(task)
            finally:
                self._live = None

    def set_status(self, text: str) -> None:
        """Text shown at the end of the live progress bar (e.g. the loss)."""
        self._status = text
        self._show()

    def set_note(self, text: str) -> None:
        """The strategy's own progress (e.g. parameter servers' updates), after the status."""
        self._note = text
        self._show()

    def _show(self) -> None:
        if self._live is not None:
            bar, task = self._live
            bar.update(task, status="  ".join(t for t in (self._status, self._note) if t))
