"""par.log in one process: bad input in one line, the one-collective reducer, JSONL resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import tracking_read as read

from manygpu import Parallel, ParallelConfig
from manygpu.errors import UsageError
from manygpu.tracking.reducer import as_vector, disagreement, reduce_rows
from manygpu.tracking.run import where_text


def test_an_unknown_tracker_is_one_line_with_a_guess() -> None:
    with pytest.raises(
        UsageError, match=r"unknown tracker 'tensorbord'.*did you mean 'tensorboard'"
    ):
        ParallelConfig(log_with=["jsonl", "tensorbord"])


def test_rows_reduce_per_key() -> None:
    a = as_vector({"loss": 1.0, "tokens": 10, "mem": torch.tensor([3.0])}, torch.device("cpu"))
    b = as_vector({"loss": 3.0, "tokens": 30, "mem": torch.tensor(5.0)}, torch.device("cpu"))
    keys = ["loss", "mem", "tokens"]
    ops = {"loss": "mean", "tokens": "sum", "mem": "max"}
    assert reduce_rows(torch.stack([a, b]), keys, ops) == {"loss": 2.0, "mem": 5.0, "tokens": 40.0}


def test_ranks_that_disagree_get_one_line_naming_each_rank() -> None:
    # What every rank builds from the exchange after a bad header: the same line.
    keys = {"keys": ["loss"], "error": None}
    more = {"keys": ["loss", "mfu"], "error": None}
    assert disagreement([keys, more, keys]) == (
        "par.log: ranks logged different keys (rank(s) 0, 2: loss; rank(s) 1: loss, mfu); "
        "every rank must log the same keys"
    )
    bad = {"keys": ["x"], "error": "log(reduce={'x': 'median'}): choose one of ..."}
    assert disagreement([keys, bad, bad]).startswith("rank 1: log(reduce={'x': 'median'})")
    assert disagreement([keys, bad, bad]).endswith("(rank(s) 2 refused their values too)")


def test_bad_values_are_one_line(tmp_path: Path) -> None:
    with Parallel(log_with="jsonl", run_dir=str(tmp_path)) as par:
        with pytest.raises(UsageError, match="1-element tensor"):
            par.log({"x": torch.ones(3)})
        with pytest.raises(UsageError, match="choose one of mean, sum, max, min"):
            par.log({"x": 1.0}, reduce={"x": "median"})


def test_a_run_says_once_where_it_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Parallel(log_with=["jsonl", "tensorboard"], run_dir=str(tmp_path)) as par:
        assert "manygpu: logging" not in capsys.readouterr().out  # nothing logged yet
        par.log({"loss": 1.0})
        par.log({"loss": 2.0})
        run_id = par.job_state.tracking()["run_id"]  # type: ignore[index]
    out = capsys.readouterr().out
    assert out.count("manygpu: logging run") == 1
    assert (
        f"manygpu: logging run {run_id}: jsonl, tensorboard in {tmp_path}/{run_id}/ "
        f"(see it: tensorboard --logdir {tmp_path})"
    ) in out
    assert where_text(("mlflow",), "runs", "x") == "mlflow at runs/mlruns"


def test_jsonl_resumes_the_stored_run_with_the_resumed_values(tmp_path: Path) -> None:
    with Parallel(log_with="jsonl", run_dir=str(tmp_path)) as par:
        for loss in (1.0, 2.0):
            par.log({"loss": loss})
        saved = par.job_state.tracking()
        par.log({"loss": 3.0})  # logged after the "checkpoint", then the job dies
    assert saved is not None and saved["last_step"] == 2
    with Parallel(log_with="jsonl", run_dir=str(tmp_path)) as par:
        par.job_state.restore(None, saved)
        for loss in (30.0, 4.0):
            par.log({"loss": loss})
    lines = read.jsonl(tmp_path / saved["run_id"] / "metrics.jsonl")
    assert sum("config" in x for x in lines) == 1
    steps = [(x["step"], x["values"]["loss"]) for x in lines if "step" in x]
    # Step 3 once, with the resumed job's value (as TensorBoard shows it), not the dead job's.
    assert steps == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 4.0)]


def test_a_missing_mlflow_file_store_permission_fails_when_parallel_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(UsageError, match="MLFLOW_ALLOW_FILE_STORE=true"):
        Parallel(log_with="mlflow", run_dir=str(tmp_path)).close()  # not at the first log


def test_a_ratio_is_every_ranks_sums_over_every_ranks_counts() -> None:
    """``{"loss": (sum, count)}`` with ``ratio``: one process's token mean; a count of 0
    is not a number; a pair without ``ratio`` (or ``ratio`` without a pair) is one line."""
    from manygpu.tracking.reducer import reduce_values

    # Two ranks' columns (sorted: the count, the sum, then lr): 10 over 4 tokens, 2 over 0.
    rows = [torch.tensor([[4.0, 10.0, 0.5]]), torch.tensor([[0.0, 2.0, 0.7]])]

    def gather(t: torch.Tensor) -> torch.Tensor:  # the header, then the values' rows
        return torch.cat([t, t]) if t.shape[1] == 3 and t[0, 2] == 1 else torch.cat(rows)

    got = reduce_values({"loss": (10.0, 4), "lr": 0.5}, {"loss": "ratio"}, gather,
                        lambda x: [x], torch.device("cpu"))  # fmt: skip
    assert got == {"loss": 12.0 / 4.0, "lr": pytest.approx(0.6)}
    with pytest.raises(UsageError, match="ratio"):
        reduce_values({"loss": (1.0, 2)}, None, lambda t: t, lambda x: [x], torch.device("cpu"))
