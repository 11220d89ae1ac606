"""Run a process under a memory cap, for tests of what a job needs in host memory.

In order of preference:

- ``cgroup2``: a child of this process's cgroup v2 with ``memory.max``, when the
  memory controller is enabled there and delegable (``+memory`` accepted by the
  parent's ``cgroup.subtree_control``; refused while the parent holds processes);
- ``cgroup1``: a child of this process's v1 memory cgroup with
  ``memory.limit_in_bytes`` (hybrid hosts and many containers, this one included);
- ``rlimit_as``: ``RLIMIT_AS``, which caps *virtual* address space: torch and
  glibc reserve far more than they touch, so the cap must be several times what
  the process uses and says little about resident memory. A last resort.

A cgroup counts resident memory (page cache included), kills the process group's
biggest process when it is exceeded (the kernel's OOM killer inside the cgroup:
SIGKILL, return code -9) and is removed when the block ends. :func:`why_not`
says in one line why none works where that is so, so a test can skip with it.
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Kind = Literal["cgroup2", "cgroup1", "rlimit_as"]


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fs type, super options) of each mount, from /proc/self/mountinfo."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _source, opts = [*right.split(), "", "", ""][:3]
        out.append((left.split()[4], fstype, opts))
    return out


def _own_cgroup(hierarchy: str) -> str | None:
    """This process's path in a hierarchy: "" for v2, a controller name for v1."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if (hierarchy == "" and names == "") or hierarchy in names.split(","):
            return path
    return None


def _v2_parent() -> tuple[Path | None, str]:
    mounts = [m for m, fs, _ in _mounts() if fs == "cgroup2"]
    own = _own_cgroup("")
    if not mounts or own is None:
        return None, "no cgroup v2 hierarchy"
    parent = Path(mounts[0]) / own.lstrip("/")
    if "memory" not in (parent / "cgroup.controllers").read_text().split():
        return None, f"cgroup v2 at {parent} has no memory controller (bound to v1 here)"
    try:
        (parent / "cgroup.subtree_control").write_text("+memory")
    except OSError as exc:
        return None, f"cgroup v2 at {parent} does not delegate memory ({exc.strerror})"
    return parent, ""


def _v1_parent() -> tuple[Path | None, str]:
    mounts = [m for m, fs, o in _mounts() if fs == "cgroup" and "memory" in o.split(",")]
    own = _own_cgroup("memory")
    if not mounts or own is None:
        return None, "no cgroup v1 memory hierarchy"
    parent = Path(mounts[0]) / own.lstrip("/")
    if not os.access(parent, os.W_OK):
        return None, f"cgroup v1 memory at {parent} is not writable (need root)"
    return parent, ""


def best() -> tuple[Kind, Path | None]:
    """The mechanism this machine allows, and the cgroup to put children under."""
    v2, _ = _v2_parent()
    if v2 is not None:
        return "cgroup2", v2
    v1, _ = _v1_parent()
    if v1 is not None:
        return "cgroup1", v1
    return "rlimit_as", None


def why_not_cgroup() -> str:
    """Why neither cgroup version can cap memory here ("" when one can)."""
    v2, why2 = _v2_parent()
    v1, why1 = (None, "") if v2 is not None else _v1_parent()
    return "" if v2 is not None or v1 is not None else f"{why2}; {why1}"


@dataclass(frozen=True)
class Cap:
    """A memory cap that processes can be put under; picklable (paths and numbers)."""

    kind: Kind
    limit_bytes: int
    cgroup: Path | None

    def enter(self) -> None:
        """Put the calling process (and what it starts later) under the cap."""
        if self.cgroup is None:
            resource.setrlimit(resource.RLIMIT_AS, (self.limit_bytes, self.limit_bytes))
        else:
            (self.cgroup / "cgroup.procs").write_text(str(os.getpid()))

    def enter_above_own(self, extra_bytes: int) -> int:
        """Cap the calling process at what it holds now plus ``extra_bytes``, then enter.

        A cgroup charges the pages a process touches after it enters, copy-on-write
        copies of its parent's pages included (a rank forked from a server that
        imported much): counting the process's own resident set into the cap keeps
        the cap about the work, not about what the fork shared. Returns the limit.
        """
        own = _rss_bytes()
        limit = own + extra_bytes
        if self.cgroup is not None:
            name = "memory.max" if self.kind == "cgroup2" else "memory.limit_in_bytes"
            (self.cgroup / name).write_text(str(limit))
        self.enter()
        return limit

    def peak_bytes(self) -> int | None:
        """The cgroup's peak usage (``None`` under RLIMIT_AS or an old v2 kernel)."""
        if self.cgroup is None:
            return None
        name = "memory.peak" if self.kind == "cgroup2" else "memory.max_usage_in_bytes"
        path = self.cgroup / name
        return int(path.read_text()) if path.exists() else None


@contextlib.contextmanager
def memory_cap(limit_bytes: int, kind: Kind | None = None) -> Iterator[Cap]:
    """A fresh cap of ``limit_bytes`` (the best kind, or ``kind``); removed afterwards.

    Processes put under it must have exited when the block ends (the cgroup
    cannot be removed before); stragglers are killed first.
    """
    chosen, parent = best()
    if kind == "rlimit_as":
        chosen, parent = "rlimit_as", None
    elif kind is not None and kind != chosen:
        raise RuntimeError(f"{kind} is not available here ({why_not_cgroup() or chosen})")
    if parent is None:
        yield Cap("rlimit_as", limit_bytes, None)
        return
    group = parent / f"manygpu-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        limit = "memory.max" if chosen == "cgroup2" else "memory.limit_in_bytes"
        (group / limit).write_text(str(limit_bytes))
        if chosen == "cgroup2":  # no swapping around the cap either
            with contextlib.suppress(OSError):
                (group / "memory.swap.max").write_text("0")
        yield Cap(chosen, limit_bytes, group)
    finally:
        _remove(group)


def _remove(group: Path) -> None:
    """Kill what is left in the cgroup, then remove it (retrying while it empties)."""
    for pid in (group / "cgroup.procs").read_text().split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), 9)
    for _ in range(50):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)
    group.rmdir()


@dataclass(frozen=True)
class CappedRun:
    """What a capped command did."""

    done: subprocess.CompletedProcess[str]
    kind: Kind
    peak_bytes: int | None
    """The cgroup's peak, read before it was removed (``None`` under RLIMIT_AS)."""


def run_capped(
    cmd: Sequence[str], limit_bytes: int, kind: Kind | None = None, **kw: Any
) -> CappedRun:
    """Run ``cmd`` (and its children) under a cap of ``limit_bytes``."""
    with memory_cap(limit_bytes, kind) as cap:
        # preexec_fn: the child enters the cap before exec, so nothing escapes it.
        done = subprocess.run(list(cmd), preexec_fn=cap.enter, capture_output=True, text=True, **kw)
        return CappedRun(done, cap.kind, cap.peak_bytes())


def _rss_bytes() -> int:
    """This process's resident set now (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0
