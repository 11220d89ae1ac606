"""torchrun's flags are accepted with torchrun's meaning (parsing and resolution, in-process)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing import Std

from manygpu import UsageError
from manygpu.cli.launch import torchrun_options
from manygpu.cli.main import build_parser
from manygpu.launch.agent import build_config, worker_command
from manygpu.launch.resolve import LaunchRequest, resolve

SCRIPT = str(Path(__file__).parents[1] / "launch" / "scripts" / "torchrun_style.py")


def _spec(*flags: str):  # type: ignore[no-untyped-def]
    ns = build_parser().parse_args(["launch", *flags, SCRIPT])
    request = LaunchRequest(
        entry=ns.entry,
        standalone=ns.standalone,
        nnodes=ns.nnodes,
        master_addr=ns.master_addr,
        torchrun=torchrun_options(ns),
    )
    return resolve(request, {}, 0)


def test_every_torchrun_flag_reaches_torchs_launch_config() -> None:
    spec = _spec(
        "--standalone",
        "--run-path",
        "--tee",
        "3",
        "--redirects",
        "0:1,1:2",
        "--local-ranks-filter",
        "0,1",
        "--monitor-interval",
        "0.5",
        "--role",
        "trainer",
        "--start-method",
        "fork",
        "--log-dir",
        "/tmp/x",
    )
    config = build_config(spec)
    assert config.role == "trainer" and config.monitor_interval == 0.5
    assert config.start_method == "fork"
    logs = config.logs_specs
    assert logs._tee == Std.ALL and logs._redirects == {0: Std.OUT, 1: Std.ERR}
    assert logs._local_ranks_filter == {0, 1}


def test_torchrun_spellings_with_underscores() -> None:
    ns = build_parser().parse_args(
        [
            "launch",
            "--no_python",
            "--local_ranks_filter",
            "1",
            "--monitor_interval",
            "2",
            "--start_method",
            "spawn",
            "--run_path",
            "prog",
        ]
    )
    assert ns.no_python and ns.run_path and ns.local_ranks_filter == "1"


def test_no_python_runs_the_program_itself() -> None:
    request = LaunchRequest(
        entry="sh",
        args=("-c", "true"),
        nproc_per_node=1,
        torchrun=torchrun_options(build_parser().parse_args(["launch", "--no-python", "sh"])),
    )
    assert worker_command(resolve(request, {}, 0)) == ("sh", ["-c", "true"])


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--tee", "7"], "--tee '7'"),
        (["--redirects", "0:9"], "--redirects"),
        (["--local-ranks-filter", "a"], "--local-ranks-filter"),
        (["--standalone", "--nnodes", "2"], "--standalone runs one node"),
        (["--standalone", "--master-addr", "10.0.0.1"], "drop --master-addr"),
        (["--role", "a b"], "--role"),
    ],
)
def test_bad_torchrun_flags_are_one_line_usage_errors(flags: list[str], needle: str) -> None:
    with pytest.raises(UsageError, match=needle):
        _spec(*flags)


def test_no_python_with_module_or_a_missing_program() -> None:
    opts = torchrun_options(build_parser().parse_args(["launch", "--no-python", "x"]))
    with pytest.raises(UsageError, match="cannot be used together"):
        resolve(LaunchRequest(entry="x", is_module=True, torchrun=opts), {}, 0)
    with pytest.raises(UsageError, match="not found"):
        resolve(LaunchRequest(entry="no-such-program-here", torchrun=opts), {}, 0)
