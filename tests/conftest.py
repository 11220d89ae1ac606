"""Shared fixtures: GPU marker handling and a clean environment per test."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests skip cleanly, with the reason, on machines without CUDA."""
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
