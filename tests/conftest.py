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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the slow directories; GPU tests skip cleanly, with the reason, without CUDA."""
    for item in items:
        path = item.path.resolve()
        if path.is_relative_to(TESTS) and path.relative_to(TESTS).parts[0] in SLOW_DIRS:
            item.add_marker(pytest.mark.slow)
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
