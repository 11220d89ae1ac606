"""Each host's command for a launch over hosts (pure), the preflight's verdicts, the report.

No network: what the plan needs to know about this machine is passed in.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from manygpu.errors import UsageError
from manygpu.launch import driven
from manygpu.launch.hosts import plan as hostplan
from manygpu.launch.hosts import probe as hostprobe
from manygpu.launch.hosts.hostfile import parse_hosts
from manygpu.launch.hosts.plan import Here, plan
from manygpu.launch.hosts.run import judge_probe, prefixed
from manygpu.launch.spec import HostOptions, LaunchRequest, TorchrunOptions

HERE = Here(
    local_names=frozenset({"node0"}),
    address="10.0.0.1",
    python="/opt/py/bin/python",
    cwd="/work/proj",
    run_id="manygpu-0123456789abcdef",
)
VARS = {"PYTHONPATH": "/work/proj/src", "NCCL_DEBUG": "INFO"}


def _plan(hosts: str = "node0:2,node1:2", **req: object) -> hostplan.HostPlan:
    opts = req.pop("opts", HostOptions(hosts=hosts))
    assert isinstance(opts, HostOptions)
    request = LaunchRequest(entry="train.py", args=("--lr", "0.1"), **req)  # type: ignore[arg-type]
    return plan(request, opts, parse_hosts(hosts), VARS, HERE)


def _remote_words(node: hostplan.NodeCommand) -> list[str]:
    """The words the remote shell runs (the last ssh argument, split as sh would)."""
    return shlex.split(node.argv[-1])


def test_first_host_here_serves_the_rendezvous_the_other_is_reached_by_ssh() -> None:
    p = _plan(timeout_s=60.0, max_restarts=2)
    here, there = p.nodes
    assert p.endpoint == "10.0.0.1:29400" and p.store_node == 0
    assert here.local and here.argv == here.launch and here.probe is None
    assert here.launch[:4] == ("/opt/py/bin/python", "-c", hostplan.BOOT, "/opt/py/bin/python")
    assert here.launch[4:8] == ("-m", "manygpu", "launch", "--driven")
    assert "--local-addr" in here.launch  # where node1's workers reach node0's
    assert not there.local and there.argv[0] == "ssh"
    assert there.argv[-2] == "node1"
    words = _remote_words(there)
    assert words[:4] == ["cd", "/work/proj", "&&", "exec"]
    # Values travel on the ssh stdin pipe, never on a command line.
    assert not any("INFO" in w for w in words) and "PYTHONUNBUFFERED=1" not in words
    assert there.env["NCCL_DEBUG"] == "INFO" and there.env["PYTHONUNBUFFERED"] == "1"
    launch = words[words.index("/opt/py/bin/python") :]
    assert launch == list(there.launch)
    for flags in (
        ["--nnodes", "2"],
        ["--rdzv-endpoint", "10.0.0.1:29400"],
        ["--rdzv-id", "manygpu-0123456789abcdef"],
        ["--max-restarts", "2"],
        ["--timeout", "60.0"],
        ["--nproc-per-node", "2"],
        ["--tee", "3"],
    ):
        i = launch.index(flags[0])
        assert launch[i : i + len(flags)] == flags
    assert launch[-3:] == ["train.py", "--lr", "0.1"]
    assert "--local-addr" not in launch  # node1 announces its own route's address


def test_ssh_options_batch_mode_timeout_port_identity_config() -> None:
    opts = HostOptions(
        hosts="node0:1,node1:1",
        ssh_port=2222,
        ssh_identity="/k/id",
        ssh_config="/k/cfg",
        ssh_connect_timeout=2.5,
    )
    ssh = _plan("node0:1,node1:1", opts=opts).nodes[1].argv
    text = " ".join(ssh)
    for part in (
        "-T",
        "-o BatchMode=yes",
        "-o ConnectTimeout=3",
        "-p 2222",
        "-i /k/id",
        "-F /k/cfg",
    ):
        assert part in text
    assert "ServerAliveInterval=5" in text


def test_default_ssh_has_no_config_flag_so_the_users_config_applies() -> None:
    assert "-F" not in _plan().nodes[1].argv


def test_remote_python_and_dir_apply_to_other_hosts_only() -> None:
    opts = HostOptions(hosts="node0:1,node1:1", remote_python="python3", remote_dir="/srv/job")
    here, there = _plan("node0:1,node1:1", opts=opts).nodes
    assert here.launch[0] == "/opt/py/bin/python" and here.cwd == "/work/proj"
    assert there.launch[0] == "python3" and there.cwd == "/srv/job"
    assert _remote_words(there)[:2] == ["cd", "/srv/job"]
    assert there.probe is not None and "-m manygpu.launch.hosts.probe" in there.probe[-1]
    assert shlex.split(there.probe[-1])[4:7] == ["python3", "-c", hostplan.BOOT]


def test_a_remote_first_host_serves_the_rendezvous_and_its_probe_checks_the_port() -> None:
    p = _plan("node1:2,node0:2")
    assert p.endpoint == "node1:29400" and p.store_node == 0
    assert p.nodes[0].probe is not None and "--bind node1:29400" in p.nodes[0].probe[-1]
    assert "--script train.py" in p.nodes[0].probe[-1]


def test_rdzv_endpoint_and_master_port_override_the_first_host() -> None:
    assert _plan(rdzv_endpoint="node1:1234").endpoint == "node1:1234"
    assert _plan(rdzv_endpoint="node1:1234").store_node == 1
    assert _plan(master_port=2345).endpoint == "10.0.0.1:2345"
    assert _plan(rdzv_endpoint="elsewhere:5").store_node is None
    with pytest.raises(UsageError, match="known rendezvous port"):
        _plan(master_port=0)


def test_elastic_host_counts_and_every_flag_travel() -> None:
    p = _plan(
        "node0:1,node1:1",
        nnodes="1:2",
        rdzv_conf="last_call_timeout=2",
        torchrun=TorchrunOptions(tee="2", monitor_interval=0.5, no_python=False),
        shutdown_grace_s=30,
    )
    assert p.elastic and (p.min_nodes, p.max_nodes) == (1, 2) and p.grace_s == 30
    launch = list(p.nodes[1].launch)
    assert launch[launch.index("--nnodes") + 1] == "1:2"
    assert launch[launch.index("--rdzv-conf") + 1] == "last_call_timeout=2"
    assert launch[launch.index("--term-timeout") + 1] == "30"
    assert launch[launch.index("-t") + 1] == "2" and launch.count("--tee") == 0
    assert launch[launch.index("--monitor-interval") + 1] == "0.5"


def test_module_entry_and_hosts_without_slots() -> None:
    request = LaunchRequest(entry="pkg.train", is_module=True)
    p = plan(request, HostOptions(hosts="node0,node1"), parse_hosts("node0,node1"), {}, HERE)
    launch = list(p.nodes[1].launch)
    assert launch[-2:] == ["-m", "pkg.train"] and "--nproc-per-node" not in launch
    assert p.nodes[1].probe is not None and "--script" not in p.nodes[1].probe[-1]


def test_a_torchrun_word_for_the_count_reaches_hosts_without_slots() -> None:
    """--nproc-per-node auto|cpu|gpu is resolved on each host, by that host's devices."""
    request = LaunchRequest(entry="t.py", nproc_per_node="gpu")
    p = plan(request, HostOptions(hosts="node0,node1:3"), parse_hosts("node0,node1:3"), {}, HERE)
    first, second = (list(n.launch) for n in p.nodes)
    assert first[first.index("--nproc-per-node") + 1] == "gpu"
    assert second[second.index("--nproc-per-node") + 1] == "3"  # its slots, as written


def test_worker_env_of_a_tool_reaches_every_host() -> None:
    p = _plan(worker_env={"MANYGPU_TOOL_CONFIG": '{"a": 1}'})
    assert p.nodes[0].env["MANYGPU_TOOL_CONFIG"] == '{"a": 1}'
    assert p.nodes[1].env["MANYGPU_TOOL_CONFIG"] == '{"a": 1}'
    assert "MANYGPU_TOOL_CONFIG" not in p.nodes[1].argv[-1]


def test_dry_run_prints_the_rendezvous_then_each_hosts_exact_command() -> None:
    p = _plan()
    lines = hostplan.dry_run(p)
    assert lines[0] == "# 2 hosts, rendezvous 10.0.0.1:29400 (c10d); each line runs on its host"
    assert lines[1].startswith("node0 (here): cd /work/proj && exec /opt/py/bin/python -c ")
    command, _, sent = lines[2].partition("  # stdin: ")
    assert command == "node1: " + shlex.join(p.nodes[1].argv)
    assert shlex.split(command.removeprefix("node1: ")) == list(p.nodes[1].argv)
    assert sent == ", ".join(sorted(p.nodes[1].env)) and "NCCL_DEBUG" in sent


def _answer(code: int, out: str = "", err: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(["ssh"], code, out, err)


HERE_VERSIONS = {"manygpu": "0.1.0", "torch": "2.13.0+cpu", "python": "3.11.7"}


def _facts(**extra: object) -> str:
    return driven_json({"versions": HERE_VERSIONS, "hostname": "n1", **extra})


def driven_json(record: dict[str, object]) -> str:
    import json

    return json.dumps(record) + "\n"


@pytest.mark.parametrize(
    "answer, words, code",
    [
        (None, "host node1 did not answer the preflight over ssh in time", 255),
        (
            _answer(255, err="ssh: connect to host node1 port 22: No route to host\n"),
            "cannot reach host node1 over ssh: ssh: connect to host node1 port 22: No route",
            255,
        ),
        (
            _answer(255, err="root@node1: Permission denied (publickey).\n"),
            "cannot reach host node1 over ssh: root@node1: Permission denied (publickey).",
            255,
        ),
        (
            _answer(1, err="/opt/py/bin/python: No module named manygpu\n"),
            "host node1 cannot run manygpu in /work/proj with /opt/py/bin/python: "
            "/opt/py/bin/python: No module named manygpu",
            1,
        ),
        (
            _answer(0, _facts(bind_error="port 29400 on node1: Address already in use")),
            "host node1 cannot serve the rendezvous: port 29400 on node1: Address already in use",
            1,
        ),
        (
            _answer(0, _facts(script_missing=True)),
            "host node1 has no script 'train.py' in /work/proj",
            2,
        ),
        (
            _answer(0, driven_json({"versions": {**HERE_VERSIONS, "torch": "2.12.0"}})),
            "host node1 has torch 2.12.0 but this machine has torch 2.13.0+cpu",
            1,
        ),
    ],
)
def test_preflight_verdicts_are_one_line_naming_the_host(
    answer: subprocess.CompletedProcess[str] | None, words: str, code: int
) -> None:
    node = _plan().nodes[1]
    verdict = judge_probe(node, answer, HERE_VERSIONS, "train.py")
    assert verdict is not None
    assert words in verdict[0] and "\n" not in verdict[0] and verdict[1] == code


def test_a_good_answer_passes() -> None:
    assert judge_probe(_plan().nodes[1], _answer(0, _facts()), HERE_VERSIONS, "train.py") is None


def test_version_mismatch_names_python_manygpu_or_torch() -> None:
    assert hostprobe.mismatch(HERE_VERSIONS, "b", HERE_VERSIONS) is None
    other = {**HERE_VERSIONS, "python": "3.12.1"}
    assert "host b has python 3.12.1 but this machine has python 3.11.7" in str(
        hostprobe.mismatch(HERE_VERSIONS, "b", other)
    )


def test_probe_facts_are_this_interpreters() -> None:
    import platform

    import torch

    import manygpu

    facts = hostprobe.probe(bind=None, script="no/such/script.py")
    assert facts["versions"] == {
        "manygpu": manygpu.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    assert facts["script_missing"] is True


def test_bind_check_sees_a_taken_port() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert "in use" in str(hostprobe.bind_error("127.0.0.1", port))
    assert hostprobe.bind_error("127.0.0.1", 0) is None


def test_lines_get_a_host_and_rank_prefix() -> None:
    assert prefixed("node1", "[rank3]:loss 0.5") == "node1/3: loss 0.5"
    assert prefixed("node1", "manygpu: waiting") == "node1: manygpu: waiting"


def test_outcome_lines_round_trip() -> None:
    from manygpu.launch import blame

    o = blame.outcome(3, 3, 100, {"time_ns": 7, "code": 3, "consequence": False})
    line = driven.TAG + '{"rank": 3, "exit_code": 3, "time_ns": 7, "consequence": false, '
    line += '"how": "rank 3 failed"}'
    parsed = driven.parse(line)
    assert parsed is not None and (parsed.rank, parsed.exit_code, parsed.time_ns) == (3, 3, 7)
    assert o.exit_code == parsed.exit_code and parsed.how == "rank 3 failed"
    assert driven.parse(driven.TAG + o.to_json()) == o
    older = driven.TAG + '{"rank": 3, "exit_code": 3, "time_ns": 7, "consequence": false, '
    older += '"text": "rank 3 failed"}'  # a host of the version before
    assert (parsed_old := driven.parse(older)) is not None and parsed_old.how == "rank 3 failed"
    assert driven.parse("[rank0]:manygpu-outcome {") is None
    assert driven.parse(driven.TAG + "{not json") is None


def test_this_machine_listed_twice_is_refused() -> None:
    here = Here(
        local_names=frozenset({"localhost", "127.0.0.1"}),
        address=None,
        python="python",
        cwd="/",
        run_id="manygpu-0123456789abcdef",
    )
    listed = parse_hosts("localhost:1,127.0.0.1:1")
    with pytest.raises(UsageError, match=r"names this machine 2 times \(localhost, 127.0.0.1\)"):
        plan(LaunchRequest(entry="t.py"), HostOptions(hosts="x"), listed, {}, here)


def test_local_names_are_this_machine() -> None:
    import socket

    from manygpu.launch.hosts.run import is_local_name

    assert is_local_name("localhost") and is_local_name("127.0.0.1")
    assert is_local_name(socket.gethostname())
    assert not is_local_name("192.0.2.1")  # TEST-NET-1: never this machine
    assert not is_local_name("no-such-host.invalid")


def test_hostfile_dry_run_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from manygpu.cli.main import main

    hostfile = tmp_path / "hosts"
    hostfile.write_text("# one line, OpenMPI style\nlocalhost slots=3\n")
    assert main(["launch", "--hostfile", str(hostfile), "--dry-run", "train.py", "--lr", "1"]) == 0
    head, line = capsys.readouterr().out.splitlines()
    assert head.startswith("# 1 host, rendezvous 127.0.0.1:29400 (c10d)")
    assert line.startswith("localhost (here): cd ")
    assert line.partition("  # stdin: ")[0].endswith("--nproc-per-node 3 train.py --lr 1")


@pytest.mark.slow
def test_boot_sets_the_variables_from_stdin_then_runs_the_command(tmp_path: Path) -> None:
    """What a host runs: the values arrive on stdin, the command line holds none,
    and the rest of stdin stays unread for the launcher (the driver's lifeline)."""
    code = "import os,sys; print(os.environ['SECRET_VALUE'], sys.argv[1:], sys.stdin.read())"
    argv = hostplan.booted(sys.executable, "-c", code, "a b")
    res = subprocess.run(
        argv, input='{"SECRET_VALUE": "s3cr3t"}\nrest', capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["s3cr3t", "['a", "b']", "rest"]
    assert not any("s3cr3t" in word for word in argv)
    empty = subprocess.run(argv, input="", capture_output=True, text=True)
    assert empty.returncode == 1 and "no job description" in empty.stderr


def _no_dns(host: str) -> list[str]:
    return {"gpu0": ["127.0.1.1"], "node0": ["10.0.0.1"]}.get(host, [])


@pytest.mark.parametrize(
    ("endpoint", "shown"),
    [
        ("127.0.0.1:29400", "127.0.0.1"),
        ("localhost:29400", "localhost"),
        ("gpu0:29400", "gpu0 (127.0.1.1)"),  # a hostname /etc/hosts maps to loopback
    ],
)
def test_dry_run_warns_once_when_remote_hosts_would_meet_on_loopback(
    endpoint: str, shown: str
) -> None:
    lines = hostplan.dry_run(_plan(rdzv_endpoint=endpoint), resolve=_no_dns)
    warnings = [line for line in lines if "warning" in line]
    assert warnings == [
        f"# warning: the rendezvous host {shown} is loopback here, which node1 cannot "
        "reach; give --master-addr (or --rdzv-endpoint) this machine's address on their network"
    ]
    assert lines[1] == warnings[0] and len(lines) == 4


def test_dry_run_says_nothing_more_when_the_rendezvous_is_reachable() -> None:
    assert not any("warning" in ln for ln in hostplan.dry_run(_plan(), resolve=_no_dns))
    assert not any(
        "warning" in ln
        for ln in hostplan.dry_run(_plan(rdzv_endpoint="node0:29400"), resolve=_no_dns)
    )
    # Every host here: loopback is right.
    alone = _plan("node0:2", rdzv_endpoint="127.0.0.1:29400")
    assert not any("warning" in ln for ln in hostplan.dry_run(alone, resolve=_no_dns))
