"""Start a :class:`LaunchSpec` with torch's elastic agent and report how it ended.

We build torch's ``LaunchConfig`` and call ``elastic_launch`` exactly as
``torchrun`` does; what we add is validation before, and a failure report
after that names the failing rank and returns its exit code.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.distributed.launcher.api as launcher_api
from torch.distributed import DistStoreError
from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStateError,
)
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from manygpu.errors import UsageError
from manygpu.launch import blame, driven, exit_barrier, hangwatch, notices, rendezvous
from manygpu.launch.netcheck import (
    check_port_free,
    check_resolves,
    is_local_address,
    source_address,
    split_endpoint,
)
from manygpu.launch.settle import settle_configuration_error
from manygpu.launch.spec import LaunchSpec
from manygpu.runtime import env as envmod
from manygpu.runtime import secret as secretmod
from manygpu.runtime.secret import JobSecret

DEFAULT_RDZV_TIMEOUT_S = 300.0
"""How long nodes wait for each other by default (``--timeout`` sets it)."""


def build_config(spec: LaunchSpec, secret: JobSecret | None = None) -> LaunchConfig:
    """torch's launch configuration for ``spec``, a job with ``secret``."""
    join_timeout = int(spec.timeout_s or DEFAULT_RDZV_TIMEOUT_S)
    if spec.rdzv_backend == "static":
        rdzv_configs: dict[str, object] = {"rank": spec.node_rank, "timeout": join_timeout}
    else:
        rdzv_configs = {"join_timeout": join_timeout}
    rdzv_configs.update(spec.rdzv_conf)
    opts = spec.torchrun
    rendezvous.register(secret)
    return LaunchConfig(
        **_supported({"shutdown_timeout": spec.shutdown_grace_s}),
        min_nodes=spec.min_nodes,
        max_nodes=spec.max_nodes,
        nproc_per_node=spec.nproc_per_node,
        run_id=spec.rdzv_id,
        role=opts.role,
        monitor_interval=opts.monitor_interval,
        start_method=opts.start_method,
        rdzv_endpoint=spec.rdzv_endpoint,
        rdzv_backend=rendezvous.BACKENDS[spec.rdzv_backend],
        rdzv_configs=rdzv_configs,
        max_restarts=spec.max_restarts,
        local_addr=spec.local_addr or source_address(split_endpoint(spec.rdzv_endpoint, 0)[0]),
        # stdout stays live (progress bars); stderr is tee'd with a rank prefix so
        # interleaved errors from several ranks can be told apart.
        logs_specs=DefaultLogsSpecs(
            log_dir=spec.log_dir,
            redirects=Std.from_str(opts.redirects) if opts.redirects else Std.NONE,
            tee=Std.from_str(opts.tee) if opts.tee else Std.ERR,
            local_ranks_filter=set(opts.local_ranks_filter) if opts.local_ranks_filter else None,
        ),
        log_line_prefix_template="[rank${rank}]:",
    )


def _supported(options: dict[str, Any]) -> dict[str, Any]:
    """The ``LaunchConfig`` fields this torch knows (``shutdown_timeout``: torch >= 2.12).

    Older torch keeps its own fixed grace period (30 s) for workers after SIGTERM.
    """
    fields = inspect.signature(LaunchConfig).parameters
    return {k: v for k, v in options.items() if k in fields}


def worker_command(spec: LaunchSpec) -> tuple[str, list[str]]:
    """The executable and arguments each worker runs."""
    if spec.torchrun.no_python:  # torchrun --no-python: the program itself
        return spec.entry, list(spec.args)
    head = ["-u", "-m", "manygpu.launch.worker"]
    entry = ["-m", spec.entry] if spec.is_module else [spec.entry]
    return sys.executable, [*head, *entry, *spec.args]


def preflight(spec: LaunchSpec) -> None:
    """Fail fast on a log directory we cannot write, or a rendezvous port that is taken."""
    if spec.log_dir is not None:
        try:
            os.makedirs(spec.log_dir, exist_ok=True)
        except OSError as exc:
            raise UsageError(
                f"--log-dir {spec.log_dir}: cannot create it ({exc.strerror}); "
                "give a writable directory"
            ) from None
    host, port = split_endpoint(spec.rdzv_endpoint, 0)
    check_resolves(host)
    hosts_store = spec.rdzv_backend == "c10d" or spec.node_rank == 0
    if port and hosts_store and is_local_address(host):
        check_port_free(host, port)


def worker_env(spec: LaunchSpec) -> dict[str, str]:
    """Variables to add to the environment the agent passes to workers."""
    env = dict(spec.extra_env)
    if spec.timeout_s is not None:
        env["MANYGPU_TIMEOUT"] = str(spec.timeout_s)
    if spec.servers is not None:
        env[envmod.PS_SERVERS] = str(spec.servers)
        # Workers that die may be dropped: their servers decide, not the agent.
        env[envmod.EXPENDABLE_FROM] = str(spec.servers)
    return env


def rendezvous_failure(spec: LaunchSpec, exc: BaseException) -> str:
    """One line for nodes that never met: how many joined, and what to do."""
    wait = int(spec.timeout_s or DEFAULT_RDZV_TIMEOUT_S)
    joined = re.search(r"(\d+)/(\d+) clients joined", str(exc))
    count = f"only {joined[1]} of {joined[2]} nodes" if joined else "not every node"
    nodes = (
        f"{spec.min_nodes}"
        if spec.min_nodes == spec.max_nodes
        else f"{spec.min_nodes}..{spec.max_nodes}"
    )
    return (
        f"{count} joined the rendezvous at {spec.rdzv_endpoint} within {wait}s (the job "
        f"needs {nodes}); start the others with the same address, port and run id, or "
        "raise --timeout"
    )


def _recorded_message(failure: ProcessFailure, whole: bool = False) -> str:
    """The rank's recorded error: its first line, cut at 300 characters (``whole``: all)."""
    if not os.path.isfile(failure.error_file):
        return ""
    message = failure.message
    text = str(message.get("message", "") if isinstance(message, Mapping) else message)
    if whole or not text:
        return text
    return text.splitlines()[0][:300]


def _outcomes(failures: Mapping[int, ProcessFailure]) -> list[blame.Outcome]:
    """Each failed rank's end, from torch's record and the worker's note."""
    return [
        blame.outcome(rank, f.exitcode, f.timestamp, blame.read(f.error_file))
        for rank, f in failures.items()
    ]


def _describe(o: blame.Outcome, failure: ProcessFailure) -> str:
    text = _recorded_message(failure)
    text = blame.tidy(text) if o.consequence else text
    detail = f": {text}" if text else ""
    if not o.how.startswith("was killed"):
        return f"rank {o.rank} {o.how}{detail}"
    at = hangwatch.crash_site(o.rank, -failure.exitcode) if failure.exitcode < 0 else ""
    pid = f" (pid {failure.pid})" + (f" at {at}" if at else "")
    killed, _, after = o.how.partition(" after ")  # "was killed by SIGABRT (pid 7) after ..."
    return f"rank {o.rank} {killed}{pid}{' after ' if after else ''}{after}{detail}"


def _lost_peers(outcomes: list[blame.Outcome], err: ChildFailedError) -> str:
    """The lead line when no rank of this node failed on its own: whom they lost."""
    texts = [_recorded_message(err.failures[o.rank], whole=True) for o in outcomes]
    try:
        hosts = Path("/etc/hosts").read_text()
    except OSError:
        hosts = ""
    return blame.lost_peers_line([o.rank for o in outcomes], texts, is_local_address, hosts)


class _AnnouncingAgent(LocalElasticAgent):
    """torch's agent, saying in one line why it restarts the workers (``--max-restarts``):
    torch restarts them silently, and the next attempt's errors hid the first's cause.
    Also: a configuration error reaches every worker before the others are stopped
    (``launch/settle.py``), and a node that ends failed counts itself out of the exit
    barrier where the nodes that finished wait (``launch/exit_barrier.py``)."""

    _last_failures: dict[int, ProcessFailure] | None = None
    _at_exit_barrier = False

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        # A node that ends failed, or stopped, never reaches torch's exit barrier: it
        # counts itself out there, its workers stopped, so the nodes that finished do
        # not wait 300 s for it (launch/exit_barrier.py).
        try:
            result = super().run(role)
        except SignalException:
            self._count_out()
            raise
        if result.is_failed():
            self._count_out()
        return result

    def _exit_barrier(self) -> None:
        # torch's wait is one store call that holds off Ctrl-C until the barrier opens.
        self._at_exit_barrier = self._in_exit_barrier = True  # torch's health check reads it
        try:
            exit_barrier.wait(self._store, self._nodes(), self._exit_barrier_timeout)
        finally:
            self._in_exit_barrier = False

    def _count_out(self) -> None:
        if self._store is not None and not self._at_exit_barrier:
            exit_barrier.count_out(self._store, self._nodes())

    def _nodes(self) -> int:
        """How many nodes the job has in this round (one before any rendezvous)."""
        return self._worker_group.group_world_size or 1

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        # torch stops every survivor at the first failure: a configuration error the
        # others are about to hit too is let through first (one line for all).
        pcontext = getattr(self, "_pcontext", None)
        settle_configuration_error(pcontext)
        result = super()._monitor_workers(worker_group)
        blame.reach_notes(result.failures, getattr(pcontext, "error_files", None) or {})
        self._last_failures = dict(result.failures)
        return result

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        failures, spec = self._last_failures, worker_group.spec
        if failures:  # a failure, not a node joining (that restart is not counted)
            root = blame.root_cause(_outcomes(failures))
            attempt = spec.max_restarts - self._remaining_restarts
            cause = _describe(root, failures[root.rank])
            print(f"manygpu: {blame.restart_line(cause, attempt, spec.max_restarts)}",
                  file=sys.stderr, flush=True)  # fmt: skip
        self._last_failures = None
        super()._restart_workers(worker_group)


@contextlib.contextmanager
def _announcing_restarts() -> Iterator[None]:
    """``elastic_launch`` builds torch's agent by name: ours stands in while it runs."""
    saved = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = _AnnouncingAgent  # type: ignore[misc]
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = saved  # type: ignore[misc]


def report_failure(err: ChildFailedError, to_driver: bool = False) -> int:
    """Print the root cause (the first failure in time), then its consequences.

    Returns the root cause's exit code (137 for a SIGKILL, 3 for ``sys.exit(3)``).
    ``to_driver``: every outcome as a line for the driver of a launch over
    hosts, which reports the job's first failure over all of them.
    """
    outcomes = _outcomes(err.failures)
    if to_driver:
        for o in outcomes:
            driven.report(o, _describe(o, err.failures[o.rank]))
        return blame.root_cause(outcomes).exit_code
    root = blame.root_cause(outcomes)
    if root.consequence:  # every rank here failed because of a rank elsewhere
        print(f"manygpu: {_lost_peers(outcomes, err)}", file=sys.stderr)
    entries = [(_describe(o, err.failures[o.rank]), o) for o in outcomes]
    for line in blame.report_lines(entries, lead=not root.consequence):
        print(f"manygpu: {line}", file=sys.stderr)
    return root.exit_code


def take_secret(spec: LaunchSpec) -> JobSecret | None:
    """The job's secret; refused when a job that meets over the network has none.

    It leaves this process's environment here: the workers inherit that
    environment and need no secret (their store is reached through a door).
    """
    secret = secretmod.load(spec.job_secret_file, envmod.current())
    envmod.drop_job_secret()
    if secret is None and secretmod.required(split_endpoint(spec.rdzv_endpoint, 0)[0]):
        raise secretmod.refusal(spec.rdzv_endpoint)
    return secret


def launch(spec: LaunchSpec) -> int:
    """Run the job to the end; returns its exit code (0, or the failing rank's)."""
    preflight(spec)
    secret = take_secret(spec)
    if spec.driven:
        driven.watch_stdin()
    # Without a log directory torch makes a torchelastic_* one in TMPDIR and
    # leaves it there; ours goes once the failure report has read it.
    own_logs = None if spec.log_dir is not None else tempfile.mkdtemp(prefix="manygpu-logs-")
    try:
        given = spec.log_dir
        return _run(spec if own_logs is None else replace(spec, log_dir=own_logs), secret, given)
    finally:
        if own_logs is not None:
            shutil.rmtree(own_logs, ignore_errors=True)


def _run(spec: LaunchSpec, secret: JobSecret | None, log_dir: str | None) -> int:
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    # Its per-worker "failed (exitcode ...)" lines repeat what report_failure says.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    # Its "Received SIGINT death signal, shutting down workers" is ours to say, once.
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
    os.environ.update(worker_env(spec))
    config = build_config(spec, secret)
    executable, args = worker_command(spec)
    with watching(spec, log_dir) as watch, notices.forwarding():
        code = _agent(spec, config, executable, args, judged=lambda: watch.verdict is not None)
        if code == 0:
            _say_if_alone(watch.out, spec.nproc_per_node)
        if watch.verdict is not None:
            if spec.driven:
                _verdict_to_driver(watch)
            return HUNG
    return code


def _say_if_alone(evidence: Path, workers: int) -> None:
    """One line when every worker of this node ran the script without a process group
    (the marks are this run's: :func:`watching` clears a kept folder's old ones)."""
    marks = list(evidence.glob("alone-rank*"))
    for mark in marks:
        mark.unlink(missing_ok=True)
    if workers > 1 and len(marks) >= workers:
        print(
            f"manygpu: the {workers} workers never formed a process group: each ran the "
            "whole script alone (same data, same output files); create a Parallel(...) "
            "or call torch.distributed.init_process_group() in the script",
            file=sys.stderr,
        )


HUNG = 124
"""The exit code of a job ended by a hang verdict (as ``timeout`` exits)."""


def _verdict_to_driver(watch: hangwatch.HangWatch) -> None:
    """Under a launch over hosts: the verdict as the job's first failure (its time is the
    alarm's), the other hosts' ends as its consequences."""
    assert watch.verdict is not None
    line, rank = watch.verdict
    judged = rank >= 0 and watch.gathers
    how = blame.Outcome(rank, HUNG, watch.alarm_ns, not judged, "hang")
    driven.report(how, f"hang: {line}" if judged else "stopped after the hang verdict")


@contextlib.contextmanager
def watching(spec: LaunchSpec, log_dir: str | None) -> Iterator[hangwatch.HangWatch]:
    """A hang watch over this node's workers while the job runs (always on).

    Its evidence goes under ``--log-dir``/hang (``log_dir``: the user's), else
    a directory of its own that is removed unless a verdict names it.
    """
    own = log_dir is None
    out = (
        Path(tempfile.mkdtemp(prefix="manygpu-evidence-")) if own else Path(log_dir or "") / "hang"
    )
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("alone-rank*"):  # an earlier run's, in a kept --log-dir
        stale.unlink(missing_ok=True)
    host = _host_label(spec)
    envmod.export_evidence(str(out), FLIGHT_RECORDS, host)
    several = spec.max_nodes > 1
    watch = hangwatch.HangWatch(
        out=out,
        host=host,
        default_timeout_s=spec.timeout_s or envmod.DEFAULT_TIMEOUT_S,
        job_store=rendezvous.hang_channel if several else lambda: None,
        end_job=_end_after_verdict,
    ).start()
    try:
        yield watch
    finally:
        watch.stop()
        if own and watch.verdict is None:
            shutil.rmtree(out, ignore_errors=True)


def _end_after_verdict() -> None:
    """Stop this node's workers as on SIGTERM; the verdict already said why."""
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
    os.kill(os.getpid(), signal.SIGTERM)


FLIGHT_RECORDS = 1000
"""torch's Flight Recorder buffer per process (records of collectives), unless set."""


def _host_label(spec: LaunchSpec) -> str:
    """How a verdict names this host: its address on the job's network, else its name."""
    host = split_endpoint(spec.rdzv_endpoint, 0)[0]
    address = spec.local_addr or source_address(host)
    if address and not secretmod.is_loopback(address):
        return address
    return socket.gethostname()


def _agent(
    spec: LaunchSpec,
    config: LaunchConfig,
    executable: str,
    args: list[str],
    judged: Callable[[], bool] = lambda: False,
) -> int:
    """Run torch's agent; ``judged``: whether a hang verdict stopped the job (its own
    SIGTERM, which no one else sent: the verdict says why, not "stopped by SIGTERM")."""
    try:
        with _announcing_restarts():
            elastic_launch(config, executable)(*args)
    except ChildFailedError as err:
        return report_failure(err, to_driver=spec.driven)
    except (RendezvousStateError, RendezvousConnectionError) as exc:
        print(f"manygpu: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    except (RendezvousError, DistStoreError) as exc:
        print(f"manygpu: {rendezvous_failure(spec, exc)}", file=sys.stderr)
        return 1
    except SignalException as exc:
        # The agent has already stopped the workers; exit like the signal did.
        _say_stopped(int(exc.sigval), spec.nproc_per_node, judged())
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        _say_stopped(signal.SIGINT, spec.nproc_per_node)
        return 128 + signal.SIGINT
    return 0


def _say_stopped(signum: int, workers: int, judged: bool = False) -> None:
    """The one line for a job stopped by a signal (torch's own warning is silenced)."""
    why = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    why = "stopped after the hang verdict" if judged else why
    print(f"manygpu: {why}; stopped {workers} worker{'s' * (workers != 1)}", file=sys.stderr)
