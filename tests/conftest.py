"""Shared fixtures: the ``slow`` and ``gpu`` markers, and a clean environment per test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
SLOW_DIRS = ("distributed", "launch", "cluster")
"""Every test in these directories starts processes (gloo ranks, the CLI, emulated
hosts), so each is ``slow``; a process-starting test elsewhere carries the mark itself.
``pytest -m "not slow"`` runs the rest in under a minute."""


# First: pytest-xdist's --dist loadgroup reads the xdist_group marks in this same hook.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the slow directories; GPU tests skip cleanly, with the reason, without CUDA.

    Emulated clusters share one subnet and one bridge, so under pytest-xdist the
    tests in tests/cluster run one at a time, on one worker.
    """
    for item in items:
        path = item.path.resolve()
        where = path.relative_to(TESTS).parts[0] if path.is_relative_to(TESTS) else ""
        if where in SLOW_DIRS:
            item.add_marker(pytest.mark.slow)
        if where == "cluster":
            item.add_marker(pytest.mark.xdist_group("cluster"))
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
