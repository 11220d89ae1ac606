"""Leftovers of an emulated cluster whose owner died (SIGKILL): found by our own names only.

Each cluster records its tag and its owner's pid in a state directory; the
next cluster to start removes the namespaces (and kills the processes in
them) of every recorded tag whose owner is gone. Namespaces we did not
record are never touched, whatever their names.
"""

from __future__ import annotations

import os
import signal
import subprocess
from contextlib import suppress
from pathlib import Path

STATE_DIR = Path("/run/manygpu-emulate")
"""Where clusters record their names (netns needs root, so /run is ours to use)."""


def claim(tag: str, names: list[str]) -> None:
    """Record that this process owns the namespaces ``names`` of cluster ``tag``."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    (STATE_DIR / tag).write_text("\n".join([str(os.getpid()), *names]))


def release(tag: str) -> None:
    """Forget cluster ``tag`` (its namespaces are gone)."""
    with suppress(OSError):
        (STATE_DIR / tag).unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale() -> list[str]:
    """Delete the namespaces of recorded clusters whose owner died; returns their names."""
    removed: list[str] = []
    for record in sorted(STATE_DIR.glob("*")) if STATE_DIR.is_dir() else []:
        try:
            owner, *names = record.read_text().split()
            if _alive(int(owner)):
                continue
        except (OSError, ValueError):
            continue
        for name in names:
            _kill_inside(name)
            res = subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
            if res.returncode == 0:
                removed.append(name)
        record.unlink(missing_ok=True)
    return removed


def _kill_inside(name: str) -> None:
    res = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, check=False)
    for pid in res.stdout.split():
        with suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
