"""Long commands say what they are doing on stderr; stdout keeps only their result.

``manygpu doctor`` was silent for 8 s and ``bench train`` for 20-40 s per job.
The notes must never reach stdout, where ``doctor --json`` promises JSON and
nothing else, and ``--quiet`` turns them off.
"""

from __future__ import annotations

import json

import pytest

from manygpu.bench.train import TrainBenchConfig
from manygpu.cli.bench_train import job_note
from manygpu.cli.main import main
from manygpu.cli.notes import Notes


def test_doctor_json_is_clean_while_notes_go_to_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["doctor", "--no-live", "--json"])
    out, err = capsys.readouterr()
    report = json.loads(out)  # stdout is the JSON and nothing else
    assert code == (1 if report["status"] == "fail" else 0)
    assert set(report) == {"status", "counts", "checks", "nodes", "live", "ray"}
    assert "manygpu doctor: probing this machine" in err
    assert "live test" not in err  # --no-live: nothing started, nothing said


def test_doctor_quiet_says_nothing_and_prints_the_same_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    main(["doctor", "--no-live", "--json", "--quiet"])
    out, err = capsys.readouterr()
    assert json.loads(out)["nodes"] and err == ""


def test_notes_are_one_line_each_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    Notes("manygpu bench train")("job 1/2: starting")
    Notes("manygpu bench train", quiet=True)("never shown")
    out, err = capsys.readouterr()
    assert out == "" and err == "manygpu bench train: job 1/2: starting\n"


def test_bench_train_job_note_says_what_the_job_does() -> None:
    config = TrainBenchConfig(steps=20, warmup=5)
    one = job_note(1, 2, 1, "resnet", config)
    assert one == (
        "job 1/2: resnet on 1 worker(s) per node: starting the workers, "
        "then 5 warm-up and 20 timed steps"
    )
    assert job_note(2, 2, 2, "gpt", config).endswith("(and as many without gradient sync)")
