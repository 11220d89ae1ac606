"""manygpu under Ray Train on a real local Ray cluster (``ray.init``: GCS, raylet, workers).

One cluster serves the module. The recipe's GPT under fsdp in a
``TorchTrainer`` of 2 workers (``Parallel`` adopts Ray's group), a
Checkpointer every 2 steps (asynchronous in one run): the last worker dies
after step 5 of the first attempt, Ray restarts the group (``max_failures=1``),
``resume()`` starts from step 4 (or 2, when the asynchronous save of 4 had not
committed) and the job ends with parameters bit-identical
to an uninterrupted run; ``Result.checkpoint`` is the last committed step and
``Result.metrics`` holds ``par.log``'s loss (the mean over ranks) and the step.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from dist_harness import run_ranks
from ray_job import in_ray, train

ray = pytest.importorskip("ray", reason="Ray Train is not installed (pip install 'manygpu[ray]')")

import manygpu.ray  # noqa: E402  (after the skip: it needs Ray)

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
SRC = Path(__file__).resolve().parents[2] / "src"
TOTAL, KILL_AT = 8, 5


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A one-node Ray cluster on loopback, 2 CPUs (one per worker), torn down after."""
    path = os.pathsep.join([str(HELPERS), str(SRC), os.environ.get("PYTHONPATH", "")])
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}},
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The same function, uninterrupted, on 2 local gloo ranks."""
    where = tmp_path_factory.mktemp("ref")
    config = {"out": str(where), "ckpt": str(where / "ck"), "total": TOTAL}
    return run_ranks(train, 2, config, extra_env={"OMP_NUM_THREADS": "1"}, timeout=180)[0]


@pytest.mark.parametrize("async_save", [True], ids=["async"])  # blocking saves: same report
def test_a_dead_worker_restarts_the_group_which_resumes_bitwise_and_ray_sees_the_steps(
    ray_cluster: None, reference: dict[str, torch.Tensor], tmp_path: Path, async_save: bool
) -> None:
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    config = {"out": str(out), "ckpt": str(ckpt), "total": TOTAL, "kill_at": KILL_AT,
              "async_save": async_save}  # fmt: skip
    result = manygpu.ray.run(
        in_ray, num_workers=2, config=config, storage_path=str(tmp_path / "ray"), max_failures=1
    )
    assert result.error is None, result.error
    assert (out / "killed").exists(), "no worker died: the restart was not tested"
    # Blocking saves: step 4 was committed before the death. An asynchronous one may
    # still have been uploading it (a save never committed), so step 2 is as right.
    resumed = {p.name for p in out.glob("resumed-from-*")}
    allowed = {"resumed-from-2", "resumed-from-4"} if async_save else {"resumed-from-4"}
    assert len(resumed) == 1 and resumed <= allowed, resumed
    params = torch.load(out / "params.pt", weights_only=True)
    assert all(torch.equal(params[k], reference[k]) for k in reference), (
        "differs from uninterrupted"
    )
    # Ray keeps a pointer to the step (Ray's form for a checkpoint kept elsewhere), not a copy.
    assert manygpu.ray.checkpoint_path(result.checkpoint) == str(ckpt / f"step-{TOTAL:08d}")
    assert result.metrics["step"] == TOTAL and "loss" in result.metrics, result.metrics
    said = (out / "said.txt").read_text()
    assert said.count("manygpu: under Ray Train: Ray started the workers") == 1, said


def test_a_missing_script_is_one_line() -> None:
    with pytest.raises(manygpu.UsageError, match="no script at"):
        manygpu.ray.run("no-such-train.py", num_workers=2)
