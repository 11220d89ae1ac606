"""Shared fixtures: the ``slow`` and ``gpu`` markers, and a clean environment per test."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

TESTS = Path(__file__).resolve().parent
SLOW_DIRS = ("distributed", "launch", "cluster")
"""Every test in these directories starts processes (gloo ranks, the CLI, emulated
hosts), so each is ``slow``; a process-starting test elsewhere carries the mark itself.
``pytest -m "not slow"`` runs the rest (74 s on 2 CPU cores with scripts/check's 2 workers)."""


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark the slow directories, and keep each tests/cluster module on one xdist worker.

    A cluster module builds its emulated cluster (and often runs its jobs) in a
    module fixture; its tests spread over workers would build it once per worker.
    A module whose every test builds its own sets ``CLUSTER_PER_TEST = True``.
    Different modules' clusters are separate namespaces and may run at once.
    Marked as each item is collected, before pytest-xdist's --dist loadgroup
    reads the marks (see constraints.txt for the pytest pin it needs).
    """
    path = item.path.resolve()
    where = path.relative_to(TESTS).parts[0] if path.is_relative_to(TESTS) else ""
    if where in SLOW_DIRS:
        item.add_marker(pytest.mark.slow)
    # A module whose tests each build their own cluster says so (CLUSTER_PER_TEST):
    # its tests may spread over the workers.
    spread = getattr(getattr(item, "module", None), "CLUSTER_PER_TEST", False)
    if where == "cluster" and not spread:
        item.add_marker(pytest.mark.xdist_group(f"cluster-{path.stem}"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Scale tests wait for MANYGPU_SCALE_TESTS=1; GPU tests skip cleanly without CUDA."""
    if os.environ.get("MANYGPU_SCALE_TESTS") != "1":
        why = "a scale test (~12 GB, minutes): MANYGPU_SCALE_TESTS=1 runs it"
        big = pytest.mark.skip(reason=why)
        for item in items:
            if "scale" in item.keywords:
                item.add_marker(big)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_job_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start as a plain single process, whatever launched pytest."""
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_JOB_ID",
        "SLURM_STEP_ID",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "MANYGPU_TIMEOUT",
    ):
        monkeypatch.delenv(name, raising=False)
    # A thread count the user chose: the launcher's one-line note on the count it
    # picks would otherwise join every launch test's expected stderr (its own test
    # unsets this: tests/launch/test_threads_note.py).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _starts_python(args: Any) -> bool:
    """Whether ``Popen(args)`` runs Python (the interpreter or the ``manygpu`` command)."""
    first = args if isinstance(args, (str, bytes, os.PathLike)) else next(iter(args), "")
    words = os.fsdecode(first).split()
    name = Path(words[0]).name if words else ""
    return name.startswith("python") or name == "manygpu"


@pytest.fixture(autouse=True)
def _slow_if_it_starts_processes(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test that starts Python processes or ranks and is not marked ``slow`` fails, saying so.

    That keeps ``pytest -m "not slow"`` fast as tests are added: each such
    process imports torch (~2.5 s of CPU). Other programs (mount, ip) are fine.
    """
    if request.node.get_closest_marker("slow"):
        return
    advice = "mark the test slow, or move it to tests/launch or tests/distributed"
    popen_init = subprocess.Popen.__init__

    def checked_popen(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
        if _starts_python(args):
            pytest.fail(f"this test starts a Python process ({args!r:.80}): {advice}")
        popen_init(self, args, *rest, **kw)

    def checked_start(self: multiprocessing.process.BaseProcess) -> None:
        pytest.fail(f"this test starts a process ({self.name}): {advice}")

    monkeypatch.setattr(subprocess.Popen, "__init__", checked_popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", checked_start)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread in the pytest process while a test runs.

    The references the equivalence tests compare with, and the unit tests' own
    math, run here on tiny models: with torch's default of one thread per core,
    each small op hands work to an OpenMP team that spins waiting on cores the
    suite keeps busy, which costs several times the op itself. The ranks already
    run with one thread (OMP_NUM_THREADS=1, see dist_harness.py).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
