"""Progress notes on stderr: what a long command is doing, never mixed into its output.

A command's stdout is its result (a table, or the JSON ``--json`` promised,
which a pipe parses), so a note on what is happening goes to stderr, where a
terminal shows it and a pipe leaves it alone. Plain one-line notes rather than
a spinner: they read the same in a terminal, a CI log and a file, and say what
took the time afterwards. ``--quiet`` turns them off.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any


def add_quiet(parser: Any) -> None:
    """The ``-q/--quiet`` flag of a command that writes progress notes."""
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress notes on stderr (results only)"
    )


@dataclass(frozen=True)
class Notes:
    """Writes ``<who>: <text>`` lines on stderr unless quiet."""

    who: str
    """The command, e.g. ``manygpu doctor``."""
    quiet: bool = False

    @classmethod
    def of(cls, who: str, ns: argparse.Namespace) -> Notes:
        return cls(who, quiet=bool(getattr(ns, "quiet", False)))

    def __call__(self, text: str) -> None:
        if not self.quiet:
            # sys.stderr is looked up at each call: a test's capture (or a
            # redirect made after start-up) gets the note.
            print(f"{self.who}: {text}", file=sys.stderr, flush=True)
