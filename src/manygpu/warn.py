"""Warnings that point at the user's line, not at ours."""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class UnpreparedDataWarning(UserWarning):
    """Training steps under a strategy that splits data, and no loader went through
    ``par.prepare``: every rank may be reading the whole data set. A job that
    shards its own data silences it with
    ``warnings.simplefilter("ignore", manygpu.warn.UnpreparedDataWarning)``."""


def _ours(filename: str) -> bool:
    """Our code, or code generated for it (a dataclass's ``__init__`` is ``<string>``)."""
    return filename.startswith("<") or os.path.abspath(filename).startswith(_PACKAGE_DIR)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first caller outside manygpu."""
    level, frame = 2, sys._getframe(1)  # level 2 is our caller's frame
    while frame is not None and _ours(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, category, stacklevel=level)
