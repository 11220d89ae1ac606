"""An argparse parser whose errors are one line and exit code 2."""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """Prints ``manygpu <cmd>: error: ...`` on one line instead of usage + error."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def positive_int(text: str) -> int:
    """argparse type: an integer (range checked by the spec, with a better message)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


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
