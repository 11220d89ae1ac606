"""A script that dies of a manygpu configuration error says it in one line.

``python train.py`` with ``Parallel(strategy="fdsp")`` would print a dozen
lines of traceback through manygpu's own frames for what one line says
(``unknown strategy 'fdsp'; did you mean 'fsdp'? ...``). The hook prints that
line for an uncaught :class:`~manygpu.errors.UsageError` and hands every other
exception (and a ``UsageError`` when ``MANYGPU_TRACEBACK=1``) to the hook it
replaced, so other tracebacks are untouched. Under ``manygpu launch`` the
worker reports the error to the launcher instead, which merges the ranks'.
"""

from __future__ import annotations

import sys
from types import TracebackType

_previous = sys.excepthook


def _hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    from manygpu.errors import UsageError
    from manygpu.runtime import env as envmod

    if isinstance(exc, UsageError) and not envmod.traceback_wanted(envmod.current()):
        print(f"manygpu: {exc} (MANYGPU_TRACEBACK=1 shows where)", file=sys.stderr)
        return
    _previous(kind, exc, tb)


def install() -> None:
    """Put the hook in place, once, over whatever hook is there now."""
    global _previous
    if sys.excepthook is not _hook:
        _previous = sys.excepthook
        sys.excepthook = _hook
