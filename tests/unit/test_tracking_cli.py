"""``--log-with`` / ``--run-dir`` of demo and bench train: parsed, and refused before any launch."""

from __future__ import annotations

import sys

import pytest

from manygpu.cli import tracking_flags
from manygpu.cli.main import build_parser, main


def test_repeated_and_comma_lists_give_each_tracker_once() -> None:
    ns = build_parser().parse_args(
        ["demo", "--log-with", "tensorboard,jsonl", "--log-with", "jsonl", "--run-dir", "d"]
    )
    assert tracking_flags.chosen(ns) == (("tensorboard", "jsonl"), "d")
    ns = build_parser().parse_args(["bench", "train", "--log-with", " mlflow , wandb"])
    assert tracking_flags.chosen(ns) == (("mlflow", "wandb"), None)
    ns = build_parser().parse_args(["demo"])
    assert tracking_flags.chosen(ns) == ((), None)  # the default run logs nothing


def _no_launch(*args: object, **kwargs: object) -> int:
    raise AssertionError("a worker was about to start")


BAD = [
    (["demo", "--log-with", "tensorbord"], "unknown tracker 'tensorbord'"),
    (["demo", "--log-with", "jsonl,nope"], "unknown tracker 'nope'"),
    (["demo", "--log-with", ","], "names no tracker"),
    (["demo", "--run-dir", "d"], "--run-dir is where the trackers of --log-with write"),
    (["demo", "--log-with", "wandb"], "pip install 'manygpu[wandb]'"),
    (["bench", "train", "--log-with", "mlfow"], "did you mean 'mlflow'"),
    (["bench", "train", "--log-with", "wandb"], "pip install 'manygpu[wandb]'"),
]


@pytest.mark.parametrize("argv, needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_trackers_are_one_line_and_exit_2_before_any_launch(
    argv: list[str],
    needle: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr("manygpu.cli.demo.launch_spec", _no_launch)
    monkeypatch.setattr("manygpu.cli.bench_train.launch_job", _no_launch)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the extra were not installed
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0], lines[0]
