"""The per-rank program of ``manygpu doctor`` (started by ``manygpu launch``).

Every rank gathers its facts; rank 0 collects them, and all ranks run a short
all-reduce and a timed exchange between every pair of ranks, each bounded by
``--op-timeout``, so a broken link is named instead of hanging. The options
come as the :class:`~manygpu.doctor.config.LiveConfig` the command built and
handed over (:mod:`manygpu.runtime.handoff`). Facts, results and the exit
code travel between ranks as JSON, checked by structure (never pickles). Rank 0 then
checks every node, compares them, prints the report, and writes it as JSON.
Every rank exits with the report's exit code, so every node's launcher agrees.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from manygpu import comm
from manygpu.comm.common import first_line
from manygpu.comm.objects import PayloadError, parse_each
from manygpu.core.parallel import Parallel
from manygpu.doctor import probes
from manygpu.doctor.checks import run_checks
from manygpu.doctor.config import LiveConfig
from manygpu.doctor.crosscheck import check_consistency, check_live
from manygpu.doctor.facts import Facts, LiveResults, PairResult
from manygpu.doctor.report import DoctorReport, render, terminal_console
from manygpu.doctor.result import CheckResult, fail
from manygpu.errors import CollectiveTimeoutError
from manygpu.runtime import handoff

REPEATS = 3
"""Timed exchanges per pair; the best one counts (the link's capacity, not noise)."""


def pairs(world_size: int) -> list[tuple[int, int]]:
    """Every pair of ranks, in an order every rank agrees on."""
    return [(a, b) for a in range(world_size) for b in range(a + 1, world_size)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_all_reduce(par: Parallel, timeout_s: float) -> tuple[float | None, str | None]:
    """(ms, error) of a 1 MB all-reduce, checked for the right sum."""
    t = torch.full((1 << 18,), float(par.rank + 1), device=par.device)
    try:
        comm.all_reduce(t.clone(), "sum", timeout_s=timeout_s)  # warm-up: connections
        _sync(par.device)
        start = time.perf_counter()
        comm.all_reduce(t, "sum", timeout_s=timeout_s)
        _sync(par.device)
        elapsed = time.perf_counter() - start
    except Exception as exc:
        return None, first_line(exc)
    expected = par.world_size * (par.world_size + 1) / 2
    if not torch.allclose(t, torch.full_like(t, expected)):
        return None, f"wrong result: got {t[0].item()}, expected {expected}"
    return elapsed * 1e3, None


def time_pairs(par: Parallel, nbytes: int, timeout_s: float) -> list[PairResult]:
    """This rank's side of every pair it belongs to.

    Pairs run one after another in the same global order on every rank, so two
    ranks always agree on what comes next, and a broken pair costs its two
    ranks one timeout, not the job.
    """
    out = []
    numel = max(nbytes // 4, 1)
    for a, b in pairs(par.world_size):
        if par.rank not in (a, b):
            continue
        peer = b if par.rank == a else a
        send = torch.full((numel,), float(par.rank), device=par.device)
        recv = torch.empty_like(send)
        try:
            seconds = _best_exchange(send, recv, peer, par.device, timeout_s)
        except Exception as exc:
            out.append(PairResult(a=a, b=b, error=first_line(exc)))
            continue
        if recv[0].item() != float(peer) or recv[-1].item() != float(peer):
            out.append(PairResult(a=a, b=b, error="received wrong data"))
            continue
        out.append(PairResult(a=a, b=b, seconds=seconds, gbps=numel * 4 / seconds / 1e9))
    return out


def _best_exchange(
    send: torch.Tensor, recv: torch.Tensor, peer: int, device: torch.device, timeout_s: float
) -> float:
    """Best of a few timed exchanges, after one that connects and touches the buffers."""
    comm.exchange(send, peer, recv, peer, timeout_s=timeout_s)
    best = float("inf")
    for _ in range(REPEATS):
        _sync(device)
        start = time.perf_counter()
        comm.exchange(send, peer, recv, peer, timeout_s=timeout_s)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def merge_pairs(per_rank: list[list[dict[str, Any]]]) -> list[PairResult]:
    """One result per pair: an error seen by either side wins; else the slower side."""
    merged: dict[tuple[int, int], PairResult] = {}
    for results in per_rank:
        for data in results:
            p = PairResult(**data)
            key = (p.a, p.b)
            old = merged.get(key)
            if (
                old is None
                or p.error
                or (old.error is None and (p.seconds or 0) > (old.seconds or 0))
            ):
                merged[key] = p
    return [merged[k] for k in sorted(merged)]


def node_labels(per_rank: list[Facts], node_ids: list[int]) -> list[str]:
    """Each rank's node as a person would name it: the hostname, with the node
    index added where two nodes share a name (containers, emulated hosts)."""
    names: dict[str, set[int]] = {}
    for f, node in zip(per_rank, node_ids, strict=True):
        names.setdefault(f.system.hostname, set()).add(node)
    return [
        f.system.hostname if len(names[f.system.hostname]) == 1 else f"{f.system.hostname}#{node}"
        for f, node in zip(per_rank, node_ids, strict=True)
    ]


def nodes_of(per_rank: list[Facts], labels: list[str]) -> list[tuple[str, Facts]]:
    """One fact set per node: its first rank's (that one probed in full)."""
    seen: dict[str, Facts] = {}
    for label, f in zip(labels, per_rank, strict=True):
        seen.setdefault(label, f)
    return list(seen.items())


def build_report(
    per_rank: list[Facts], live: LiveResults | None, node_ids: list[int] | None = None
) -> DoctorReport:
    """Check every node, compare the ranks, judge the live test."""
    labels = node_labels(per_rank, node_ids or [0] * len(per_rank))
    nodes = nodes_of(per_rank, labels)
    multi = len(nodes) > 1
    checks = [r for label, f in nodes for r in run_checks(f, label if multi else "")]
    if len(per_rank) > 1:
        checks += check_consistency(per_rank, labels)
    if live is not None:
        live.hosts = labels
        checks += check_live(live)
    return DoctorReport(nodes=[f for _, f in nodes], checks=checks, live=live)


def _node_and_facts(value: Any) -> tuple[int, Facts]:
    """A rank's ``[node_rank, facts]`` as :func:`run` sends it."""
    node, data = value  # a ValueError when it is not a pair
    if not isinstance(node, int) or isinstance(node, bool) or not isinstance(data, dict):
        raise TypeError(f"expected [node_rank, facts], got [{type(node).__name__}, ...]")
    facts = Facts.from_dict(data)
    if not isinstance(facts.system.hostname, str):  # a dict key in node_labels
        raise TypeError("facts.system.hostname is not a string")
    return node, facts


def _pair_dicts(value: Any) -> list[dict[str, Any]]:
    """A rank's pair results as :func:`live_test` sends them (``vars`` of each
    :class:`PairResult`), checked field by field."""
    if not isinstance(value, list):
        raise TypeError(f"expected a list of pair results, got {type(value).__name__}")
    out = []
    for data in value:
        p = PairResult(**data)  # a TypeError for a missing or unknown field
        numbers = (p.seconds, p.gbps)
        if (
            not all(isinstance(n, int) and not isinstance(n, bool) for n in (p.a, p.b))
            or not all(n is None or isinstance(n, int | float) for n in numbers)
            or not (p.error is None or isinstance(p.error, str))
        ):
            raise TypeError(f"pair result {data!r:.80} has a field of the wrong type")
        out.append(vars(p))
    return out


def run(config: LiveConfig) -> int:
    """Probe, test and report on every rank; the report's exit code on every rank."""
    timeout_s = config.op_timeout_s
    # Bounds the exchanges of facts, results and the exit code (JSON); each test has its own.
    exchange_s = max(2 * timeout_s, 30.0)
    with Parallel(strategy="ddp", timeout_s=exchange_s) as par:
        facts = probes.gather(full=par.local_rank == 0)
        mine = [par.cluster.node_rank, facts.to_dict()]
        sent = comm.all_gather_json(mine, operation="doctor facts", timeout_s=exchange_s)
        gathered = parse_each(sent, _node_and_facts, operation="doctor facts")
        node_ids = [node for node, _ in gathered]
        per_rank = [f for _, f in gathered]
        live: LiveResults | None = None
        extra: list[CheckResult] = []
        failed = False
        if config.live:
            live, extra, failed = live_test(par, config.nbytes, timeout_s, exchange_s)
        code = 0
        if par.is_main:
            report = build_report(per_rank, live, node_ids)
            report.checks += extra
            code = emit(report, config)
        try:
            code = _shared_exit_code(code, exchange_s)
        except CollectiveTimeoutError:
            failed = True
        if failed:
            # A timed-out operation may still be pending in the backend; a
            # normal teardown could block on it. The report is out already.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code or 1)
    return code


def live_test(
    par: Parallel, nbytes: int, timeout_s: float, exchange_s: float
) -> tuple[LiveResults, list[CheckResult], bool]:
    """(results, extra findings, whether anything failed) of the timed tests.

    Each test is bounded by ``timeout_s``; gathering the results (as JSON) by ``exchange_s``.
    When they cannot be collected from every rank, rank 0 reports what it saw
    itself, and says so.
    """
    ms, error = time_all_reduce(par, timeout_s)
    mine = time_pairs(par, nbytes, timeout_s)
    failed = error is not None or any(p.error for p in mine)
    extra: list[CheckResult] = []
    operation = "doctor live results"
    try:
        sent = comm.all_gather_json(
            [vars(p) for p in mine], operation=operation, timeout_s=exchange_s
        )
        everyone = parse_each(sent, _pair_dicts, operation=operation)
    except (CollectiveTimeoutError, PayloadError) as exc:
        everyone, failed = [[vars(p) for p in mine]], True
        extra.append(
            fail(
                "collect",
                f"could not collect the live results from every rank: {exc}",
                "the pairs below are rank 0's view; look for the rank that stopped answering",
            )
        )
    live = LiveResults(
        backend=str(torch.distributed.get_backend()),
        world_size=par.world_size,
        nbytes=nbytes,
        all_reduce_ms=ms,
        all_reduce_error=error,
        pairs=merge_pairs(everyone),
    )
    return live, extra, failed


def _exit_code(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an exit code, got {type(value).__name__}")
    return value


def _shared_exit_code(code: int, timeout_s: float) -> int:
    """Rank 0's exit code on every rank."""
    operation = "doctor exit code"
    sent = comm.broadcast_json(code, 0, operation=operation, timeout_s=timeout_s)
    return parse_each([sent], _exit_code, operation=operation)[0]  # only rank 0 sends


def emit(report: DoctorReport, config: LiveConfig) -> int:
    """Print and write the report on rank 0; the job's exit code."""
    data = report.to_dict()
    if config.out:
        Path(config.out).write_text(json.dumps(data, indent=2) + "\n")
    if config.format == "json":
        print(json.dumps(data, indent=2), flush=True)
    elif config.format == "text":
        render(report, terminal_console())
    # A silent run reports through its file; the caller judges it.
    return 0 if config.format == "none" else report.exit_code


def main(config: LiveConfig) -> int:
    return run(config)


if __name__ == "__main__":
    sys.exit(main(handoff.received(LiveConfig)))
