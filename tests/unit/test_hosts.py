"""Host lists for a launch over hosts: -H, host files in every format, -np, -x, .manygpu_env.

Pure functions of text; every bad input is one line that names what to change,
and through the CLI it exits 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from manygpu.cli.main import main
from manygpu.errors import UsageError
from manygpu.launch.hosts.hostfile import (
    Host,
    allocate,
    parse_env_file,
    parse_exports,
    parse_hostfile,
    parse_hosts,
)
from manygpu.runtime.env import forwarded


def test_dash_h_is_hosts_with_slots_in_order() -> None:
    assert parse_hosts("server1:4,server2:4, 10.0.0.3:2") == (
        Host(name="server1", slots=4),
        Host(name="server2", slots=4),
        Host(name="10.0.0.3", slots=2),
    )


def test_a_host_without_slots_lets_the_host_decide() -> None:
    assert parse_hosts("a,b:2") == (Host(name="a"), Host(name="b", slots=2))


def test_ipv6_in_brackets_and_user_at_host() -> None:
    v6, user = parse_hosts("[fe80::2]:4,alice@node1:2")
    assert v6 == Host(name="[fe80::2]", slots=4) and v6.address == "fe80::2"
    assert user.slots == 2 and user.address == "node1"


HOSTFILE = """\
# Horovod, OpenMPI and DeepSpeed lines may be mixed; comments and blank lines are skipped

server1:4
server2 slots=4          # OpenMPI / DeepSpeed
server3 slots=2 max_slots=8
   server4
"""


def test_hostfile_reads_every_format() -> None:
    assert parse_hostfile(HOSTFILE, "hosts.txt") == (
        Host(name="server1", slots=4),
        Host(name="server2", slots=4),
        Host(name="server3", slots=2),
        Host(name="server4"),
    )


@pytest.mark.parametrize(
    "text, words",
    [
        ("a:0", "slots '0' must be a whole number >= 1"),
        ("a:x", "slots 'x' must be a whole number >= 1"),
        ("a:4,,b:4", "empty entry"),
        ("a:4,a:2", "lists a twice"),
        ("-oProxyCommand=x:1", "is not a host name"),
        ("fe80::2:4", "is not a host name"),
        ("a b:4", "is not a host name"),
    ],
)
def test_bad_dash_h_is_one_line(text: str, words: str) -> None:
    with pytest.raises(UsageError, match=words) as info:
        parse_hosts(text)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "text, words",
    [
        ("a slots=0\n", "hosts.txt line 1: slots '0'"),
        ("a\nb slots=four\n", "hosts.txt line 2: slots 'four'"),
        ("a:2 slots=2\n", "line 1: slots given twice"),
        ("a cpus=2\n", "line 1: unknown 'cpus=2'; write HOST slots=N"),
        ("a slots=2\n# again\na slots=2\n", "hosts.txt lists a twice"),
        ("# only comments\n\n", "hosts.txt lists no host"),
        ("a max_slots=-1\n", "line 1: slots '-1'"),
    ],
)
def test_bad_hostfile_names_the_line(text: str, words: str) -> None:
    with pytest.raises(UsageError, match=words) as info:
        parse_hostfile(text, "hosts.txt")
    assert "\n" not in str(info.value)


def test_np_fills_the_slots_in_host_order() -> None:
    listed = parse_hosts("a:4,b:4,c:4")
    assert allocate(listed, 6, None) == (Host(name="a", slots=4), Host(name="b", slots=2))
    assert allocate(listed, 12, None) == listed
    assert allocate(listed, None, None) == listed


def test_nproc_per_node_gives_slots_to_hosts_that_have_none() -> None:
    listed = parse_hosts("a,b:1")
    assert allocate(listed, None, 3) == (Host(name="a", slots=3), Host(name="b", slots=1))
    assert allocate(listed, None, None) == listed  # a runs its own default
    assert allocate(listed, 4, 3) == (Host(name="a", slots=3), Host(name="b", slots=1))


def test_np_beyond_the_slots_or_unknown_slots_is_refused() -> None:
    with pytest.raises(UsageError, match="-np 9 is more than the 8 slots of a:4,b:4"):
        allocate(parse_hosts("a:4,b:4"), 9, None)
    with pytest.raises(UsageError, match="-np 2 needs each host's slots but a has none"):
        allocate(parse_hosts("a,b:4"), 2, None)


def test_env_file_lines() -> None:
    text = "# comment\nNCCL_IB_DISABLE=1\nexport A='x y'\nB=\"q\"\n\nC=a=b\nEMPTY=\n"
    assert parse_env_file(text, ".manygpu_env") == {
        "NCCL_IB_DISABLE": "1",
        "A": "x y",
        "B": "q",
        "C": "a=b",
        "EMPTY": "",
    }
    with pytest.raises(UsageError, match=r"\.manygpu_env line 2: 'not a pair' is not KEY=VALUE"):
        parse_env_file("A=1\nnot a pair\n", ".manygpu_env")
    with pytest.raises(UsageError, match="line 1: '1A=2' is not KEY=VALUE"):
        parse_env_file("1A=2\n", ".manygpu_env")


def test_exports_set_or_pass_a_variable() -> None:
    env = {"WANDB_API_KEY": "k", "HOME": "/root"}
    assert parse_exports(["WANDB_API_KEY", "LR=0.1", "EMPTY="], env) == {
        "WANDB_API_KEY": "k",
        "LR": "0.1",
        "EMPTY": "",
    }
    with pytest.raises(UsageError, match="-x MISSING: MISSING is not set here; give -x MISSING="):
        parse_exports(["MISSING"], env)
    with pytest.raises(UsageError, match="-x '=1'"):
        parse_exports(["=1"], env)


def test_only_the_collectives_ours_device_lists_and_stores_are_forwarded() -> None:
    env = {
        "NCCL_DEBUG": "INFO",
        "GLOO_SOCKET_IFNAME": "eth0",
        "MANYGPU_TIMEOUT": "60",
        "PYTHONPATH": "/src",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "HIP_VISIBLE_DEVICES": "0",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "HOME": "/root",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_ENDPOINT_URL": "http://10.0.0.1:9000",
        "GOOGLE_APPLICATION_CREDENTIALS": "/etc/gcs.json",
        "AZURE_STORAGE_ACCOUNT_NAME": "acct",
        "AZURE_CLIENT_SECRET": "not an object store's own",
        "PATH": "/bin",
        "LD_LIBRARY_PATH": "/x",
        "SSH_AUTH_SOCK": "/tmp/agent",
    }
    assert forwarded(env) == {
        k: env[k]
        for k in (
            "NCCL_DEBUG",
            "GLOO_SOCKET_IFNAME",
            "MANYGPU_TIMEOUT",
            "PYTHONPATH",
            "CUDA_VISIBLE_DEVICES",
            "HIP_VISIBLE_DEVICES",
            "CUDA_DEVICE_ORDER",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_ENDPOINT_URL",
            "GOOGLE_APPLICATION_CREDENTIALS",
            "AZURE_STORAGE_ACCOUNT_NAME",
        )
    }


def _run(argv: list[str]) -> int:
    """The CLI's exit code, whether argparse (SystemExit) or a UsageError refused."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.mark.parametrize(
    "args, words",
    [
        (["-H", "a:0"], "-H 'a:0': slots '0' must be a whole number >= 1"),
        (["-H", "a:2", "--hostfile", "f"], "give -H/--hosts or --hostfile, not both"),
        (["--hostfile", "/nonexistent/hosts"], "--hostfile /nonexistent/hosts: cannot read it"),
        (["-H", "a:2,b:2", "-np", "5"], "-np 5 is more than the 4 slots"),
        (["-H", "a:2", "--node-rank", "1"], "drop --node-rank"),
        (["-H", "a:2", "--rdzv-backend", "static"], "drop --rdzv-backend static"),
        (["-H", "a:2,b:2", "--nnodes", "3"], "--nnodes 3 but the host list has 2 hosts"),
        (["-H", "a:2,b:2", "--nnodes", "3:4"], "must hold the 2 listed hosts"),
        (["-H", "a:2", "-x", "NOPE_NOT_SET_ANYWHERE"], "-x NOPE_NOT_SET_ANYWHERE: NOPE_NOT_SET"),
        (["--ssh-port", "2222"], "--ssh-port is for a launch over hosts; add -H or --hostfile"),
        (["--dry-run"], "--dry-run is for a launch over hosts"),
        (["-H", "a:2", "--ssh-port", "70000"], "--ssh-port 70000 is outside 1..65535"),
        (["-np", "2", "--nproc-per-node", "3"], "-np 2 and --nproc-per-node 3 disagree"),
        (["-H", "a:2", "--ssh-connect-timeout", "0"], "'0' must be greater than 0"),
    ],
)
def test_cli_bad_host_input_is_one_line_exit_2(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    assert _run(["launch", *args, str(script)]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err


def test_hostfile_errors_through_the_cli_name_the_file_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=lots\n")
    script = tmp_path / "train.py"
    script.write_text("")
    assert _run(["launch", "--hostfile", str(hostfile), "--dry-run", str(script)]) == 2
    err = capsys.readouterr().err
    assert f"{hostfile} line 2: slots 'lots'" in err and err.count("\n") == 1


def test_np_without_hosts_is_processes_on_this_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`horovodrun -np 2 python train.py` becomes `manygpu launch -np 2 train.py`."""
    import manygpu.cli.launch as cli_launch

    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(cli_launch, "launch_job", lambda ns, *a, **k: seen.append(ns) or 0)
    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["launch", "-np", "3", str(script)]) == 0
    assert seen[0].nproc_per_node == 3
