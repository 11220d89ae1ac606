"""An argparse parser whose errors are one line and exit code 2, and flags from dataclasses.

Building the parser must stay cheap (``manygpu --help`` answers in well under a
second), so nothing here, and nothing a subcommand's ``add_parser`` imports,
may import torch: help texts that list names only a heavy module knows are
filled in when help is shown (:meth:`OneLineParser.help_later`).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from manygpu.flags import flagged


class OneLineParser(argparse.ArgumentParser):
    """Prints ``manygpu <cmd>: error: ...`` on one line instead of usage + error."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._help_later: list[tuple[argparse.Action, Callable[[], str]]] = []

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)

    def parse_known_args(  # type: ignore[override]
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """argparse's, and a flag this (sub)command does not take that is close to one it
        does is refused here, by its own name: ``--nproc`` -> ``--nproc-per-node``."""
        ns, extras = super().parse_known_args(args, namespace)
        for extra in extras:
            guess = self.close_flag(extra)
            if guess is not None:
                flag = extra.split("=", 1)[0]
                self.error(f"unrecognized argument {flag}; did you mean {guess}?")
        return ns, extras

    def close_flag(self, given: str) -> str | None:
        """The flag ``given`` probably meant: one it begins (its ``-`` spelling first),
        else the closest by spelling; ``None`` for no flag or no close one."""
        flag = given.split("=", 1)[0]
        if not flag.startswith("--"):
            return None
        known = sorted(o for o in self._option_string_actions if o.startswith("--"))
        longer = [o for o in known if o.startswith(flag)]
        if longer:
            return min(longer, key=lambda o: (o.count("_"), len(o)))
        # Names without their dashes: "--" alike in every flag makes "--bogus" "--gpus".
        names = {o[2:]: o for o in known}
        close = difflib.get_close_matches(flag[2:], list(names), n=1, cutoff=0.75)
        return names[close[0]] if close else None

    def help_later(self, action: argparse.Action, text: Callable[[], str]) -> None:
        """Give ``action`` the help ``text()``, computed only when help is printed.

        For lists that live in modules importing torch (strategy names,
        all-reduce algorithms): building the parser must not import them.
        """
        self._help_later.append((action, text))

    def format_help(self) -> str:
        for action, text in self._help_later:
            action.help = text()
        self._help_later.clear()
        return super().format_help()


def add_flags(
    parser: argparse.ArgumentParser, cls: type[Any], only: Iterable[str] | None = None
) -> None:
    """Add the command-line flags declared on dataclass ``cls`` (all, or those named ``only``).

    The destination of each flag is its field's name, so :func:`given_flags`
    can build the dataclass back from the namespace.
    """
    names = None if only is None else set(only)
    for f, flag in flagged(cls):
        if names is not None and f.name not in names:
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "help": flag.help}
        if flag.switch:
            kwargs["action"] = "store_true"
        else:
            # A repeated flag collects into a fresh list (its field's ``convert`` makes it a tuple).
            kwargs["default"] = None if flag.repeat else f.default
            if flag.repeat:
                kwargs["action"] = "append"
            if flag.parse is not None:
                kwargs["type"] = flag.parse
            if flag.choices is not None:
                kwargs["choices"] = flag.choices
            if flag.metavar is not None:
                kwargs["metavar"] = flag.metavar
        parser.add_argument(*flag.names, **kwargs)


def given_flags(cls: type[Any], ns: argparse.Namespace) -> dict[str, Any]:
    """The values of ``cls``'s flags found in ``ns``, as keyword arguments for ``cls``.

    Flags a command does not take are left out, so the dataclass's defaults
    apply; each value passes through its flag's ``convert`` (which may raise a
    ``UsageError`` naming the flag).
    """
    values: dict[str, Any] = {}
    for f, flag in flagged(cls):
        if hasattr(ns, f.name):
            value = getattr(ns, f.name)
            values[f.name] = flag.convert(value) if flag.convert is not None else value
    return values
