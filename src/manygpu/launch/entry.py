"""Is the script a user named there? Answered before torch loads, with a suggestion.

A mistyped path is the commonest first mistake; it should cost a glance, not
the seconds torch takes to import, and it should say what was probably meant
(``did you mean 'train.py'?``) or that a directory was given instead of a file.
Pure file-system checks, no torch: the launcher asks before anything else.
"""

from __future__ import annotations

import difflib
import os


def script_problem(entry: str, cwd: str = ".") -> str | None:
    """Why ``entry`` (relative to ``cwd``) is not a Python file to run, or ``None``."""
    path = os.path.join(cwd, entry)
    if os.path.isfile(path):
        return None
    if os.path.isdir(path):
        inside = _python_files(path)
        example = f", e.g. {os.path.join(entry, inside[0])!r}" if inside else ""
        return f"{entry!r} is a directory; give the path of a Python file{example}"
    folder = os.path.dirname(entry)
    names = _python_files(os.path.join(cwd, folder) if folder else cwd)
    close = difflib.get_close_matches(os.path.basename(entry), names, n=1, cutoff=0.6)
    hint = f" (did you mean {os.path.join(folder, close[0])!r}?)" if close else ""
    return f"script {entry!r} not found{hint}; give the path of a Python file"


def _python_files(folder: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(folder) if n.endswith(".py"))
    except OSError:
        return []
