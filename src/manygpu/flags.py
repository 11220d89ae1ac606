"""Command-line flags declared where the setting lives: on a dataclass field.

A configuration dataclass names each field's flags, help text and text parser
in the field's metadata (:func:`option`, :func:`switch`). The CLI builds its
argparse arguments from that metadata and the dataclass from the parsed
namespace by field name, so adding a setting is one edit and the command line
cannot drift from the library. The text parsers live here too, because both
sides name them; this module imports nothing heavier than ``argparse``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any

from manygpu.errors import UsageError

METADATA_KEY = "manygpu.flag"
"""Key of a field's :class:`Flag` in ``dataclasses.field(metadata=...)``."""


@dataclass(frozen=True, kw_only=True)
class Flag:
    """How one dataclass field is typed on the command line."""

    names: tuple[str, ...]
    """Its spellings, e.g. ``("--nproc-per-node", "--nproc_per_node")`` (torchrun's too)."""
    help: str | None = None
    """The ``--help`` line; ``None`` lists the flag without one."""
    parse: Callable[[str], Any] | None = None
    """argparse's ``type``: text -> value, raising ``ArgumentTypeError`` with the reason."""
    choices: tuple[str, ...] | None = None
    """The only values argparse accepts (listed in ``--help`` and in its error)."""
    metavar: str | None = None
    """The value's name in ``--help`` when it should not be the field's name in capitals."""
    convert: Callable[[Any], Any] | None = None
    """Parsed value -> field value, for checks that must read as a ``UsageError``."""
    switch: bool = False
    """A flag without a value: present means ``True``."""
    repeat: bool = False
    """May be given several times; the values are collected in order (argparse ``append``)."""


def option(
    *names: str,
    default: Any = None,
    help: str | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    convert: Callable[[Any], Any] | None = None,
    repeat: bool = False,
) -> Any:
    """A dataclass field with a default that is also the command-line flag ``names``."""
    flag = Flag(
        names=names,
        help=help,
        parse=parse,
        choices=choices,
        metavar=metavar,
        convert=convert,
        repeat=repeat,
    )
    return field(default=default, metadata={METADATA_KEY: flag})


HIDDEN = argparse.SUPPRESS
"""``help=HIDDEN`` keeps a flag out of ``--help``: for flags one manygpu process passes another."""


def switch(*names: str, help: str | None = None) -> Any:
    """A boolean dataclass field (default ``False``) set by the value-less flag ``names``."""
    return field(default=False, metadata={METADATA_KEY: Flag(names=names, help=help, switch=True)})


def flag_of(f: Field[Any]) -> Flag | None:
    """The command-line flag of dataclass field ``f``, ``None`` when it has none."""
    flag = f.metadata.get(METADATA_KEY)
    return flag if isinstance(flag, Flag) else None


def flagged(cls: type[Any]) -> list[tuple[Field[Any], Flag]]:
    """The fields of dataclass ``cls`` that are command-line flags, in declaration order."""
    pairs = [(f, flag_of(f)) for f in fields(cls)]
    return [(f, flag) for f, flag in pairs if flag is not None]


# -- text parsers: argparse's ``type`` for the flags above and every CLI module ---------


def positive_int(text: str) -> int:
    """argparse type: an integer (range checked by the spec, with a better message)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


NPROC_WORDS = ("auto", "cpu", "gpu")
"""torchrun's words for --nproc-per-node: the GPUs, else the CPUs; the CPUs; the GPUs."""


def nproc_value(text: str) -> int | str:
    """argparse type: a worker count, or one of torchrun's words (:data:`NPROC_WORDS`)."""
    if text in NPROC_WORDS:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an integer or one of {', '.join(NPROC_WORDS)}"
        ) from None


def positive_float(text: str) -> float:
    """argparse type: a finite number greater than zero (inf and nan are refused)."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be greater than 0")
    return value


def finite_float(text: str) -> float:
    """argparse type: a finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = positive_int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


def fraction(text: str) -> float:
    """argparse type: a number in (0, 1], e.g. an assumed MFU."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r} is a fraction: give a number in (0, 1]")
    return value


SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
"""Size suffixes, powers of 1024 (a trailing ``B`` is allowed: ``64KB``)."""
MAX_SIZE = 1 << 40
"""The largest size accepted (1024G): more is a typo, and would otherwise run
until memory ran out instead of failing in a second."""
SIZE_EXAMPLES = "write e.g. 8, 64K, 1M or 1G"


def parse_size(text: str, flag: str = "size") -> int:
    """``"64M"`` -> 67108864; K, M, G are powers of 1024; fractions of a byte drop.

    ``flag`` (e.g. ``"--max-bytes"``) starts each error, so it names what to fix.

    Raises:
        UsageError: one line, for text that is not a number with an optional
            unit, or a size that is infinite, not a number, below 0 or above
            :data:`MAX_SIZE` (``int(float("inf"))`` would otherwise escape as
            an ``OverflowError`` traceback).
    """
    clean = text.strip().upper().removesuffix("B")
    unit = SIZE_UNITS.get(clean[-1:], 1)
    try:
        value = float(clean[:-1] if unit > 1 else clean) * unit
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not a size; {SIZE_EXAMPLES}") from None
    if not math.isfinite(value):
        raise UsageError(f"{flag} {text!r} is not a finite size; {SIZE_EXAMPLES}")
    if value < 0:
        raise UsageError(f"{flag} {text!r} must be 0 or more bytes; {SIZE_EXAMPLES}")
    if value > MAX_SIZE:
        raise UsageError(f"{flag} {text!r} is more than 1024G; {SIZE_EXAMPLES}")
    return int(value)
