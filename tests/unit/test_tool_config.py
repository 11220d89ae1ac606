"""Options declared once: launch flags from the spec's fields, tools' configs handed to workers."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from manygpu.bench.comm import CommBenchConfig, SweepConfig
from manygpu.bench.train import TrainBenchConfig, TrainJob
from manygpu.cli.launch import launch_request
from manygpu.cli.main import build_parser
from manygpu.demo.config import DemoConfig
from manygpu.doctor.config import LiveConfig
from manygpu.errors import UsageError
from manygpu.flags import flag_of, flagged
from manygpu.launch.spec import (
    LaunchRequest,
    LaunchSpec,
    Placement,
    ProgramOptions,
    TorchrunOptions,
)
from manygpu.runtime import handoff
from manygpu.runtime.env import TOOL_CONFIG

CONFIGS = [
    CommBenchConfig(
        sweep=SweepConfig(ops=("all_reduce", "broadcast"), min_bytes=64, max_bytes=1024),
        json_path="out.json",
        label="x",
        command="manygpu bench comm --label x",
    ),
    TrainJob(bench=TrainBenchConfig(model="gpt", strategy="fsdp", peak_tflops=9.5), out="r.json"),
    LiveConfig(format="none", out="/tmp/r.json", nbytes=1 << 20, op_timeout_s=3.0, live=False),
    DemoConfig(epochs=2, strategy="single", precision="bf16", json_path=None),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: type(c).__name__)
def test_a_config_reaches_the_workers_unchanged(config: object) -> None:
    env = handoff.worker_env(config)
    assert list(env) == [TOOL_CONFIG]
    assert handoff.received(type(config), env) == config


def test_a_worker_without_its_config_says_who_starts_it() -> None:
    with pytest.raises(UsageError, match="started by its manygpu command"):
        handoff.received(LiveConfig, {})
    with pytest.raises(UsageError, match="holds a DemoConfig, not a LiveConfig"):
        handoff.received(LiveConfig, handoff.worker_env(DemoConfig()))


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: LiveConfig(format="xml"), "report format"),
        (lambda: LiveConfig(op_timeout_s=0), "--op-timeout"),
        (lambda: TrainJob(out="r.json", threads=-1), "--threads"),
        (lambda: TrainJob(out=""), "a file for its results"),
        (lambda: DemoConfig(lr=float("nan")), "--lr"),
        (lambda: DemoConfig(image_size=4), "at least 6"),
        (lambda: SweepConfig(warmup=-1), "0 or more"),
    ],
)
def test_configs_check_themselves(make: object, needle: str) -> None:
    with pytest.raises(UsageError, match=needle):
        make()  # type: ignore[operator]


def test_every_launch_option_is_a_flag_of_every_launching_command() -> None:
    shared = [f.name for cls in (Placement, ProgramOptions) for f, _ in flagged(cls)]
    parser = build_parser()
    for argv in (["launch", "x.py"], ["bench", "comm"], ["bench", "train"], ["doctor"]):
        ns = parser.parse_args(argv)
        assert all(hasattr(ns, name) for name in shared), argv
    ns = parser.parse_args(["launch", "x.py"])
    assert all(hasattr(ns, f.name) for f, _ in flagged(TorchrunOptions))


def test_the_request_is_built_from_the_flags_by_name() -> None:
    ns = build_parser().parse_args(
        ["launch", "--term-timeout", "7", "--max_restarts", "2", "--local-ranks-filter", "0,1",
         "--rdzv-backend", "static", "--standalone", "-m", "pkg.mod", "--lr", "3"]
    )  # fmt: skip
    req = launch_request(ns, ns.entry, ns.is_module, tuple(ns.args))
    assert req.shutdown_grace_s == 7 and req.max_restarts == 2 and req.standalone
    assert req.rdzv_backend == "static" and req.torchrun.local_ranks_filter == (0, 1)
    assert (req.entry, req.is_module, req.args) == ("pkg.mod", True, ("--lr", "3"))
    # Commands without torchrun's flags get its defaults.
    bench = build_parser().parse_args(["bench", "comm"])
    req = launch_request(bench, "m", True, ())
    assert req.torchrun == TorchrunOptions() and not req.standalone


def test_the_options_used_as_given_are_shared_by_request_and_spec() -> None:
    shared = {f.name for f in fields(ProgramOptions)}
    assert shared <= {f.name for f in fields(LaunchRequest)}
    assert shared <= {f.name for f in fields(LaunchSpec)}
    assert all(flag_of(f) is None for f in fields(LaunchSpec) if f.name not in shared)


def test_bad_local_ranks_filter_names_the_flag() -> None:
    ns = argparse.Namespace(local_ranks_filter="a")
    with pytest.raises(UsageError, match="--local-ranks-filter 'a'"):
        launch_request(ns, "x.py", False, ())
