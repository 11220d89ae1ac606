"""Which GPU a process takes, and when Slurm bound GPUs to its tasks (pure rules, no GPU).

Under ``srun --gpus-per-task=1`` (or ``--gpu-bind``) every task sees one GPU, its
own, as GPU 0, while its ``SLURM_LOCALID`` runs 0..k-1: ``cuda:LOCAL_RANK`` would
not exist for all but the first.
"""

from __future__ import annotations

import pytest

from manygpu.errors import UsageError
from manygpu.runtime import env as envmod
from manygpu.runtime.device import cuda_index


@pytest.mark.parametrize(
    ("local_rank", "visible", "bound", "want"),
    [
        (0, 4, False, 0),
        (3, 4, False, 3),
        (3, 1, True, 0),  # srun --gpus-per-task=1: each task its own GPU 0
        (0, 1, True, 0),
        (2, 4, True, 2),  # bound to several (--gpus-per-task=4 on one task each): as usual
    ],
)
def test_cuda_index(local_rank: int, visible: int, bound: bool, want: int) -> None:
    assert cuda_index(local_rank, visible, bound) == want


def test_more_processes_than_gpus_is_one_line_and_names_the_binding() -> None:
    with pytest.raises(UsageError) as plain:
        cuda_index(2, 2, False)
    assert "--nproc-per-node 2 or fewer" in str(plain.value) and "Slurm" not in str(plain.value)
    with pytest.raises(UsageError) as bound:
        cuda_index(2, 2, True)
    assert "--gpus-per-task=1" in str(bound.value) and "\n" not in str(bound.value)


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, False),
        ({"SLURM_GPUS_PER_TASK": "1"}, True),
        ({"SLURM_GPU_BIND": "single:1"}, True),
        ({"SLURM_GPU_BIND": "none"}, False),
        ({"SLURM_JOB_GPUS": "0,1,2,3"}, False),  # GPUs allocated, not bound per task
    ],
)
def test_gpus_bound_per_task(env: dict[str, str], want: bool) -> None:
    assert envmod.gpus_bound_per_task(env) is want
