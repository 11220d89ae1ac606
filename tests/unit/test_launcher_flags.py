"""What users bring from torchrun, accelerate launch and horovodrun: --nproc-per-node's
words, --strategy / --precision defaults, --network-interface, --output-filename."""

from __future__ import annotations

from pathlib import Path

import pytest

from manygpu import Parallel, UsageError
from manygpu.cli.launch import launch_request
from manygpu.cli.launch_extras import apply_extras
from manygpu.cli.main import build_parser
from manygpu.launch.resolve import nproc_count, resolve
from manygpu.runtime import env as envmod
from manygpu.runtime.device import cpu_count

SCRIPT = str(Path(__file__).parents[1] / "launch" / "scripts" / "torchrun_style.py")


def _ns(*flags: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["launch", *flags, SCRIPT])


@pytest.mark.parametrize(
    ("word", "gpus", "expected"),
    [("auto", 0, cpu_count()), ("auto", 4, 4), ("cpu", 4, cpu_count()), ("gpu", 8, 8), (3, 8, 3)],
)
def test_torchruns_words_for_the_worker_count(word: int | str, gpus: int, expected: int) -> None:
    assert nproc_count(word, gpus) == expected


def test_nproc_words_parse_and_resolve_on_this_node() -> None:
    ns = _ns("--nproc-per-node", "auto")
    spec = resolve(launch_request(ns, ns.entry, False, ()), {}, 0)
    assert spec.nproc_per_node == cpu_count()
    with pytest.raises(UsageError, match="no CUDA GPU"):
        ns = _ns("--nproc-per-node", "gpu")
        resolve(launch_request(ns, ns.entry, False, ()), {}, 0)


def test_the_extras_become_the_workers_variables_and_logs() -> None:
    ns = _ns("--strategy", "fsdp", "--precision", "bf16", "--network-interface", "lo",
             "--output-filename", "/tmp/o")  # fmt: skip
    env = apply_extras(ns, local=True)
    assert env == {
        "MANYGPU_STRATEGY": "fsdp",
        "MANYGPU_PRECISION": "bf16",
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
    }
    assert (ns.log_dir, ns.tee) == ("/tmp/o", "3")
    spec = resolve(launch_request(ns, ns.entry, False, (), env), {}, 0)
    assert spec.extra_env["GLOO_SOCKET_IFNAME"] == "lo"  # over the single-node default
    assert spec.extra_env["MANYGPU_STRATEGY"] == "fsdp"


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--strategy", "fdsp"], "--strategy: unknown strategy 'fdsp'; did you mean 'fsdp'?"),
        (["--precision", "fp4"], "--precision 'fp4': choose one of auto, fp32"),
        (["--network-interface", "nope0"], "'nope0': no such interface here; this machine has"),
        (["--output-filename", "/a", "--log-dir", "/b"], "give one"),
    ],
)
def test_bad_extras_are_one_line(flags: list[str], needle: str) -> None:
    with pytest.raises(UsageError) as info:
        apply_extras(_ns(*flags), local=True)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_another_hosts_interface_is_not_checked_here() -> None:
    assert (
        apply_extras(_ns("--network-interface", "ib7"), local=False)["NCCL_SOCKET_IFNAME"] == "ib7"
    )


def test_the_codes_own_argument_wins_over_the_launchers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MANYGPU_PRECISION", "bf16")
    monkeypatch.setenv("MANYGPU_STRATEGY", "single")
    with Parallel() as par:
        assert (par.strategy_name, par.config.precision) == ("single", "bf16")
    with Parallel(precision="fp32") as par:
        assert par.config.precision == "fp32"
    given = {"mesh": {"dp": 1}}
    assert envmod.launcher_defaults(envmod.current(), given) == {"precision": "bf16"}
