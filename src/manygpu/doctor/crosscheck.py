"""Checks across ranks: same software and GPUs everywhere, and the live test's
links, naming the slow or broken link or node. Pure functions of data."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence

from manygpu.doctor.facts import Facts, LiveResults, PairResult
from manygpu.doctor.result import CheckResult, fail, ok, warn
from manygpu.runtime.ranks import ranks_text

SLOW_FRACTION = 0.10
"""A pair below this fraction of the median pair's bandwidth is named as slow."""

# What must match on every rank (fail) and what should (warn).
MUST_MATCH: dict[str, Callable[[Facts], object]] = {
    "python": lambda f: f.system.python,
    "torch": lambda f: f.torch.version,
    "CUDA": lambda f: f.torch.cuda or f.torch.hip,
    "NCCL": lambda f: f.torch.nccl,
}
SHOULD_MATCH: dict[str, Callable[[Facts], object]] = {
    "cuDNN": lambda f: f.torch.cudnn,
    "driver": lambda f: f.driver.version,
    "GPU model": lambda f: ", ".join(sorted({g.name for g in f.gpus})) or "no GPU",
}


def _where(ranks: list[int], hosts: Sequence[str]) -> str:
    names = sorted({hosts[r] for r in ranks if r < len(hosts)})
    shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
    return f"{ranks_text(ranks)} ({shown})" if names else ranks_text(ranks)


def check_consistency(
    per_rank: Sequence[Facts], hosts: Sequence[str] | None = None
) -> list[CheckResult]:
    """Same versions and GPU models on every rank; names who differs.

    ``hosts`` names each rank's node (default: its hostname).
    """
    hosts = list(hosts) if hosts is not None else [f.system.hostname for f in per_rank]
    out = []
    for table, status in ((MUST_MATCH, fail), (SHOULD_MATCH, warn)):
        for what, get in table.items():
            groups: dict[str, list[int]] = defaultdict(list)
            for rank, facts in enumerate(per_rank):
                groups[str(get(facts))].append(rank)
            if len(groups) < 2:
                continue
            parts = [
                f"{value} on {_where(ranks, hosts)}"
                for value, ranks in sorted(groups.items(), key=lambda kv: kv[1][0])
            ]
            out.append(
                status(
                    "consistency",
                    f"{what} differs across ranks: {'; '.join(parts)}",
                    "install the same versions on every node (one container image or lock file)",
                )
            )
    if out:
        return out
    f = per_rank[0] if per_rank else None
    if f is None:
        return []
    nodes = len(set(hosts))
    return [
        ok(
            "consistency",
            f"{len(per_rank)} ranks on {nodes} node(s): python {f.system.python}, "
            f"torch {f.torch.version}, CUDA {f.torch.cuda or '-'}, NCCL {f.torch.nccl or '-'}",
        )
    ]


def _name(rank: int, hosts: Sequence[str]) -> str:
    return f"rank {rank} ({hosts[rank]})" if rank < len(hosts) else f"rank {rank}"


def check_all_reduce(live: LiveResults) -> list[CheckResult]:
    if live.all_reduce_error:
        return [
            fail(
                "all_reduce",
                f"all-reduce across {live.world_size} ranks failed: {live.all_reduce_error}",
                "see the broken links below; a firewall or a wrong interface is the usual cause",
            )
        ]
    return [
        ok(
            "all_reduce",
            f"all-reduce across {live.world_size} ranks ({live.backend}) in "
            f"{live.all_reduce_ms:.1f} ms",
        )
    ]


def _bad_node(live: LiveResults, bad: Sequence[PairResult]) -> list[int]:
    """Ranks whose every link is bad, when they have at least two peers."""
    if live.world_size < 3:
        return []
    count: dict[int, int] = defaultdict(int)
    for p in bad:
        count[p.a] += 1
        count[p.b] += 1
    return sorted(r for r, c in count.items() if c == live.world_size - 1)


def check_links(live: LiveResults) -> list[CheckResult]:
    """Every pair's exchange finished, none far slower than the median pair."""
    hosts, out = live.hosts, []
    broken = [p for p in live.pairs if p.error is not None or p.gbps is None]
    speeds = [p.gbps for p in live.pairs if p.gbps is not None]
    median = statistics.median(speeds) if speeds else 0.0
    slow = [
        p
        for p in live.pairs
        if p.gbps is not None and len(speeds) >= 3 and p.gbps < SLOW_FRACTION * median
    ]
    for r in _bad_node(live, broken + slow):
        out.append(
            fail(
                "node",
                f"{_name(r, hosts)} is slow or broken with every peer",
                "look at that node: its network interface, cabling, or a rank stuck elsewhere",
            )
        )
    for p in broken:
        out.append(
            fail(
                "link",
                f"link {_name(p.a, hosts)} <-> {_name(p.b, hosts)} is broken: {p.error}",
                "check that both hosts reach each other on the chosen interface (firewall, "
                "GLOO/NCCL_SOCKET_IFNAME)",
            )
        )
    for p in slow:
        out.append(
            warn(
                "link",
                f"link {_name(p.a, hosts)} <-> {_name(p.b, hosts)} runs at {p.gbps:.3g} GB/s, "
                f"{100 * (p.gbps or 0) / median:.0f}% of the median pair ({median:.3g} GB/s)",
                "check that pair's path: a slower NIC, TCP instead of RDMA, or a congested switch",
            )
        )
    if out:
        return out
    if not speeds:
        return []
    return [
        ok(
            "links",
            f"{len(speeds)} rank pair(s) exchanged {live.nbytes >> 20} MB: "
            f"{min(speeds):.3g}-{max(speeds):.3g} GB/s (median {median:.3g})",
        )
    ]


def check_live(live: LiveResults) -> list[CheckResult]:
    return check_all_reduce(live) + check_links(live)
