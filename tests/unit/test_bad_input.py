"""Misuse of the API is refused at once, in one line, not later inside torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from manygpu import DDP, FSDP, Parallel, ParallelConfig, Pipeline, UsageError


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_preparing_a_model_or_optimizer_twice_is_refused(strategy: str) -> None:
    with Parallel(strategy=strategy) as par:
        model = nn.Linear(3, 2)
        wrapped = par.prepare(model)
        for again in (model, wrapped):
            with pytest.raises(UsageError, match="model was already prepared"):
                par.prepare(again)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        prepared = par.prepare(opt)
        for again in (opt, prepared):
            with pytest.raises(UsageError, match="optimizer was already prepared"):
                par.prepare(again)


# -- the CLI: one line on stderr, exit code 2, never a traceback ------------------
S = "tests/launch/scripts/torchrun_style.py"
CLI_BAD: list[tuple[list[str], str]] = [
    (["launch", "--timeout", "inf", S], "not a finite number"),
    (["launch", "--timeout", "nan", S], "not a finite number"),
    (["launch", "--timeout", "-1", S], "--timeout: '-1' must be greater than 0"),
    (["launch", "--timeout", "abc", S], "not a number"),
    (["launch", "--term-timeout", "-5", S], "0 or more"),
    (["launch", "--log-dir", "/proc/nope", S], "--log-dir /proc/nope"),
    (["launch", "-m", "no_such_module_xyz"], "module 'no_such_module_xyz' not found"),
    (["launch", "-m", "1bad"], "not a module name"),
    (["launch", "--nproc-per-node", "abc", S], "not an integer"),
    (["launch", "--nproc-per-node", "0", S], "--nproc-per-node"),
    (["launch", "--max-restarts", "-1", S], "--max-restarts"),
    (["launch", "--rdzv-conf", "garbage", S], "--rdzv-conf"),
    (["launch", "--nnodes", "0", S], "--nnodes"),
    (["launch", "--nnodes", "x", S], "--nnodes"),
    (["launch", "--master-port", "70000", S], "port 70000"),
    (["launch", "--nnodes", "2", S], "--master-addr"),
    (["launch", "--node-rank", "5", "--nnodes", "2", "--master-addr", "127.0.0.1", S], "5"),
    (["launch", "--gpus", "", S], "--gpus"),
    (["launch", "--gpus", "0,0", S], "twice"),
    (["launch", "--gpus", "all", S], "no CUDA GPU"),
    (["launch", "--gpus", "0,x", S], "--gpus '0,x'"),
    (["launch", "--gpus", "7", S], "GPU 7"),
    (["launch", "--rdzv-backend", "etcd", S], "invalid choice"),
    (["launch", "--tee", "9", S], "--tee"),
    (["launch", "--standalone", "--nnodes", "3", S], "--standalone"),
    (["launch", "--start-method", "thread", S], "invalid choice"),
    (["launch", "--monitor-interval", "0", S], "greater than 0"),
    (["launch", "nope.py"], "not found"),
    (["launch", "tests/launch/scripts/fail.py"], "did you mean 'tests/launch/scripts/fails.py'?"),
    (["launch", "tests/launch/scripts"], "'tests/launch/scripts' is a directory; give the path"),
    (
        ["launch", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.9.8.7:1", S],
        "export MANYGPU_JOB_SECRET=",
    ),
    (["launch", "--job-secret-file", "/nonexistent/secret", S], "cannot read it"),
    (["launch"], "give the script to run: manygpu launch [options] train.py"),
    (["bench", "comm", "--iters", "-1"], "0 or more"),
    (["bench", "comm", "--warmup", "-3"], "0 or more"),
    (["bench", "comm", "--ops", "nope"], "nope"),
    (["bench", "comm", "--min-bytes", "xyz"], "xyz"),
    (["bench", "comm", "--max-bytes", "inf"], "--max-bytes 'inf' is not a finite size"),
    (["bench", "comm", "--max-bytes", "infK"], "--max-bytes 'infK' is not a finite size"),
    (["bench", "comm", "--max-bytes", "nan"], "--max-bytes 'nan' is not a finite size"),
    (["bench", "comm", "--max-bytes", "1e400M"], "not a finite size"),
    (["bench", "comm", "--max-bytes=-1K"], "--max-bytes '-1K' must be 0 or more bytes"),
    (["bench", "comm", "--max-bytes", "1e30"], "--max-bytes '1e30' is more than 1024G"),
    (["bench", "comm", "--min-bytes", "1e30K"], "--min-bytes '1e30K' is more than 1024G"),
    (["doctor", "--p2p-bytes", "inf"], "--p2p-bytes 'inf' is not a finite size"),
    (["doctor", "--p2p-bytes", "infG"], "--p2p-bytes 'infG' is not a finite size"),
    (["doctor", "--p2p-bytes", "nanK"], "--p2p-bytes 'nanK' is not a finite size"),
    (["doctor", "--p2p-bytes=-4"], "--p2p-bytes '-4' must be 0 or more bytes"),
    (["doctor", "--p2p-bytes", "1e30"], "--p2p-bytes '1e30' is more than 1024G"),
    (["bench", "comm", "--dtype", "float7"], "float7"),
    (["bench", "nope"], "invalid choice"),
    (["plan"], "--model or --params"),
    (["plan", "--params", "nan"], "not a finite number"),
    (["plan", "--params", "-5"], "0 or more"),
    (["plan", "--params", "1e9", "--mfu", "5"], "(0, 1]"),
    (["plan", "--params", "1e9", "--mfu", "0"], "greater than 0"),
    (["plan", "--params", "1e9", "--layers", "4"], "add --hidden, --seq"),
    (["plan", "--params", "1e9", "--seq", "-1"], "0 or more"),
    (["plan", "--params", "1e9", "--json", "/proc/nope/x.json"], "--json"),
    (["plan", "--params", "1e9", "--gpu-memory-gb", "inf"], "not a finite number"),
    (["plan", "--params", "1e9", "--cluster", "nope"], "nope"),
    (["demo", "--epochs", "0"], "--epochs"),
    (["demo", "--workers", "0"], "at least 1"),
    (["demo", "--strategy", "nope"], "unknown strategy"),
    (["demo", "--precision", "fp4"], "unknown precision 'fp4'"),
    (["demo", "--workers", "2", "--global-batch-size", "1"], "smaller than the world size"),
    (["checkpoint", "inspect", "/nonexistent"], "does not exist"),
    (["checkpoint", "export", "/nonexistent", "/tmp/x.safetensors"], "does not exist"),
    (["doctor", "--bogus"], "unrecognized arguments"),
    (["doctor", "--ray", "auto", "--all-ranks"], "--ray reports a Ray cluster, --all-ranks a"),
    (
        ["launch", "--nproc", "2", "train.py"],
        "manygpu launch: error: unrecognized argument --nproc; did you mean --nproc-per-node?",
    ),
    (["launch", "--max-restart=1", "train.py"], "did you mean --max-restarts?"),
    (["launch", "--nprocs-per-node", "2", "train.py"], "did you mean --nproc-per-node?"),
    (["nosuchcmd"], "invalid choice"),
]


@pytest.mark.parametrize("argv, needle", CLI_BAD, ids=[" ".join(a)[:50] for a, _ in CLI_BAD])
def test_cli_bad_input_is_one_line_and_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from manygpu.cli.main import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0], lines[0]


@pytest.mark.parametrize("text", ["inf", "-infK", "nanM", "1e400", "-1", "1e30K", "1025G"])
def test_size_parser_refuses_sizes_no_run_could_use(text: str) -> None:
    """A huge --max-bytes once ran until memory ran out; inf escaped as an OverflowError."""
    from manygpu.flags import parse_size

    with pytest.raises(UsageError, match=f"^--max-bytes '{text}' "):
        parse_size(text, "--max-bytes")


def test_size_parser_still_reads_sizes() -> None:
    from manygpu.flags import parse_size

    sizes = ["0", "8", "1e3", "64K", "1.5M", " 1gb ", "1024G"]
    assert [parse_size(s) for s in sizes] == [0, 8, 1000, 64 << 10, 3 << 19, 1 << 30, 1 << 40]


def test_cli_checkpoint_export_to_a_directory_or_unwritable_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from manygpu.checkpoint import Checkpointer, TrainState
    from manygpu.cli.main import main

    with Parallel(strategy="single") as par:
        Checkpointer(par, tmp_path / "ck", model=par.prepare(nn.Linear(2, 2))).save(
            TrainState(step=1)
        )
    (tmp_path / "out").mkdir()
    for target, needle in ((tmp_path / "out", "is a directory"), (Path("/proc/x.st"), "cannot")):
        assert main(["checkpoint", "export", str(tmp_path / "ck"), str(target)]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err, err
    assert not list(tmp_path.rglob("*.tmp"))


# -- the API: a specific exception with the fix in its message --------------------
def _parallel(**kw: Any) -> None:
    Parallel(**kw).close()


API_BAD: list[tuple[Any, type[Exception], str]] = [
    (lambda: _parallel(strategy="single", timeout_s=float("nan")), UsageError, "timeout_s"),
    (lambda: _parallel(strategy="single", timeout_s=float("inf")), UsageError, "timeout_s"),
    (lambda: _parallel(strategy="single", timeout_s="5"), UsageError, "timeout_s"),
    (lambda: _parallel(strategy="single", timeout_s=-1), UsageError, "timeout_s"),
    (lambda: _parallel(strategy="nope"), UsageError, "unknown strategy"),
    (lambda: _parallel(device="tpu9"), UsageError, "'tpu9' is not a device; use \"cpu\""),
    (lambda: _parallel(device="cuda:x"), UsageError, '"cuda:N"'),
    (lambda: _parallel(device=""), UsageError, "'' is not a device"),
    (lambda: _parallel(device=0), UsageError, "device takes a string"),
    (lambda: ParallelConfig(device="tpu9"), UsageError, "'tpu9' is not a device"),
    (lambda: _parallel(strategy="single", grad_accum_steps=0), UsageError, "grad_accum_steps"),
    (lambda: _parallel(strategy="single", precision="fp8"), UsageError, "precision"),
    (lambda: _parallel(mesh={"xx": 2}), UsageError, "unknown mesh dimension"),
    (lambda: _parallel(strategy="hybrid"), UsageError, "mesh"),
    (lambda: _parallel(strategy="model", mesh={"tp": 2}), UsageError, "cannot use mesh"),
    (lambda: FSDP(param_dtype="fp8"), UsageError, "param_dtype"),
    (lambda: FSDP(block_classes=(3,)), UsageError, "block_classes"),
    (lambda: DDP(bucket_cap_mb=0), UsageError, "bucket_cap_mb"),
    (lambda: DDP(grad_compression="int4"), UsageError, "grad_compression"),
    (lambda: Pipeline(microbatches=0), UsageError, "microbatches"),
    (lambda: Pipeline(schedule="zb"), UsageError, "schedule"),
    (lambda: Pipeline(balance="time"), UsageError, "example_input"),
]


@pytest.mark.parametrize("call, error, needle", API_BAD)
def test_api_bad_input_raises_a_specific_error(
    call: Any, error: type[Exception], needle: str
) -> None:
    with pytest.raises(error, match=needle):
        call()


COMM_CALLS: dict[str, Any] = {
    "all_reduce": lambda comm, x: comm.all_reduce(x, "sum"),
    "reduce": lambda comm, x: comm.reduce(x),
    "broadcast": lambda comm, x: comm.broadcast(x),
    "all_gather": lambda comm, x: comm.all_gather(x),
    "all_gather_uneven": lambda comm, x: comm.all_gather_uneven(x),
    "reduce_scatter": lambda comm, x: comm.reduce_scatter(x),
    "all_to_all": lambda comm, x: comm.all_to_all(x),
    "send": lambda comm, x: comm.send(x, 0),
    "recv": lambda comm, x: comm.recv(x, 0),
    "exchange": lambda comm, x: comm.exchange(x, 0, torch.zeros(2), 0),
}


@pytest.mark.parametrize("name", sorted(COMM_CALLS))
@pytest.mark.parametrize("value", [[1, 2], 3.0, None], ids=["list", "float", "None"])
def test_comm_refuses_what_is_not_a_tensor(name: str, value: Any) -> None:
    """One process used to hand a list straight back; more ranks would then fail in torch."""
    import manygpu.comm as comm

    with pytest.raises(UsageError, match=f"^manygpu.comm.{name} needs a torch.Tensor, not "):
        COMM_CALLS[name](comm, value)


def test_bad_timeout_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw in ("abc", "-5", "nan"):
        monkeypatch.setenv("MANYGPU_TIMEOUT", raw)
        with pytest.raises(UsageError, match="MANYGPU_TIMEOUT"):
            _parallel(strategy="single")


def test_exit_grace_from_the_environment() -> None:
    from manygpu.runtime.env import DEFAULT_EXIT_GRACE_S, exit_grace_s

    assert exit_grace_s({}) == DEFAULT_EXIT_GRACE_S
    assert exit_grace_s({"MANYGPU_EXIT_GRACE": "0"}) == 0.0
    assert exit_grace_s({"MANYGPU_EXIT_GRACE": "2.5"}) == 2.5
    for raw in ("abc", "-1", "inf"):
        with pytest.raises(UsageError, match="MANYGPU_EXIT_GRACE"):
            exit_grace_s({"MANYGPU_EXIT_GRACE": raw})


def test_checkpointer_bad_counts_and_a_file_for_a_directory(tmp_path: Path) -> None:
    from manygpu.checkpoint import Checkpointer

    with Parallel(strategy="single") as par:
        model = par.prepare(nn.Linear(2, 2))
        for kw in ({"every": -1}, {"keep": -2}, {"every": 1.5}):
            with pytest.raises(UsageError, match="give an integer >= 0"):
                Checkpointer(par, tmp_path / "ck", model=model, **kw)
        (tmp_path / "file").write_text("x")
        with pytest.raises(UsageError, match="is a file"):
            Checkpointer(par, tmp_path / "file", model=model)


def test_resume_into_a_model_of_another_shape_names_the_misfit(tmp_path: Path) -> None:
    from manygpu.checkpoint import Checkpointer, CheckpointError, TrainState

    with Parallel(strategy="single") as par:
        Checkpointer(par, tmp_path, model=par.prepare(nn.Linear(2, 2))).save(TrainState(step=1))
        other = Checkpointer(par, tmp_path, model=par.prepare(nn.Linear(2, 3)))
        with pytest.raises(CheckpointError, match="does not fit this model") as info:
            other.resume()
        assert "\n" not in str(info.value)


def test_an_unresolvable_rendezvous_address_fails_at_once() -> None:
    from manygpu.launch.netcheck import check_resolves

    with pytest.raises(UsageError, match="cannot resolve the rendezvous address"):
        check_resolves("no-such-host.invalid")


def test_a_port_held_on_every_address_is_caught() -> None:
    import socket

    from manygpu.launch.netcheck import check_port_free

    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(UsageError, match=f"master port {port} on 127.0.0.1 is already in use"):
            check_port_free("127.0.0.1", port)


def test_a_port_held_on_another_local_address_does_not_stop_the_store() -> None:
    """Our store listens on its own address only, so the same port elsewhere is no clash."""
    import socket
    from datetime import timedelta

    from manygpu.launch.netcheck import check_port_free
    from manygpu.launch.rendezvous import serve_store

    with socket.socket() as holder:
        holder.bind(("127.0.0.2", 0))
        holder.listen()
        port = holder.getsockname()[1]
        check_port_free("127.0.0.1", port)
        store = serve_store("127.0.0.1", port, timedelta(seconds=5))
        store.set("k", "v")
        assert store.get("k") == b"v"


def test_nodes_that_never_met_are_counted_in_one_line() -> None:
    from torch.distributed import DistStoreError

    from manygpu.launch.agent import rendezvous_failure
    from manygpu.launch.spec import LaunchSpec

    spec = LaunchSpec(
        entry="x.py",
        min_nodes=3,
        max_nodes=3,
        rdzv_backend="static",
        rdzv_endpoint="10.0.0.1:29500",
        timeout_s=5,
    )
    text = rendezvous_failure(spec, DistStoreError("Timed out ... 2/3 clients joined."))
    assert text.startswith("only 2 of 3 nodes joined the rendezvous at 10.0.0.1:29500 within 5s")
    assert "\n" not in text
