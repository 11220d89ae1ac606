"""The planner's parameter-server model: the push/pull formula, ps against the ring,
and where async parameter servers win (stragglers)."""

from __future__ import annotations

import pytest

from manygpu.errors import UsageError
from manygpu.plan import perf
from manygpu.plan.desc import ModelDesc
from manygpu.plan.hardware import Cluster
from manygpu.plan.memory import estimate as memory_estimate
from manygpu.plan.recommend import recommend
from manygpu.plan.uneven_hosts import HostRates, ps_sync_step_s, ring_step_s, samples_per_s

GBIT = 1 / 8  # GB/s of 1 Gbit/s
MODEL = 25e6 * 4  # 25M fp32 parameters: the bytes of gradients and of weights


def _hosts(n: int, compute_s: float = 0.1, bw: float = GBIT) -> list[HostRates]:
    return [HostRates(compute_s=compute_s, bw_gbs=bw) for _ in range(n)]


def test_push_pull_formula() -> None:
    # 3 workers, 1 server, 100 MB each way at 1 GB/s, 10 us: the server's link
    # carries 3 x 100 MB per phase: (300 + 300) MB / 1 GB/s + 2 x 10 us.
    t = perf.push_pull_s(1e8, 1e8, workers=3, servers=1, bw_gbs=1.0, latency_us=10.0)
    assert t == pytest.approx(0.6 + 20e-6)
    # As many servers as workers: each link carries one model per phase.
    assert perf.push_pull_s(1e8, 1e8, 3, 3, 1.0, 10.0) == pytest.approx(0.2 + 20e-6)
    # More servers than workers cannot beat a worker's own link.
    assert perf.push_pull_s(1e8, 1e8, 2, 4, 1.0, 0.0) == pytest.approx(0.2)


def _cluster(nodes: int, gbit: float) -> Cluster:
    return Cluster(name="cpu hosts", nodes=nodes, gpus_per_node=1, memory_gb=16,
                   peak_tflops=0.1, intra_bw_gbs=10.0, intra_latency_us=10.0,
                   inter_bw_gbs=gbit / 8, inter_latency_us=50.0, overlap=False)  # fmt: skip


def test_estimate_counts_only_workers_and_exposes_the_exchange() -> None:
    desc = ModelDesc(name="m", parameters=25_000_000, step_compute_s=0.2, compute_batch=32)
    cluster = _cluster(4, 1.0)
    ps = perf.estimate(desc, cluster, "ps", batch=32, stages=1)
    ring = perf.estimate(desc, cluster, "ddp", batch=32)
    expected = perf.push_pull_s(MODEL, MODEL, 3, 1, GBIT, 50.0)
    assert ps.comm_s == pytest.approx(expected) and ps.exposed_s == ps.comm_s
    assert ps.samples_per_s == pytest.approx(3 * 32 / (0.2 + expected))
    assert ps.efficiency == pytest.approx(0.2 / (0.2 + expected) * 3 / 4)
    # Uniform hosts: the ring moves 2 (N-1)/N of the model per rank, one server 6x: ring wins.
    assert ring.samples_per_s > 2 * ps.samples_per_s
    with pytest.raises(UsageError, match="servers"):
        perf.estimate(desc, cluster, "ps", batch=32, stages=4)


def test_the_planner_lists_ps_with_its_server_counts_and_memory() -> None:
    desc = ModelDesc(name="m", parameters=25_000_000, step_compute_s=0.2, compute_batch=32)
    plan = recommend(desc, _cluster(8, 1.0), batch=32)
    ways = sorted(c.ways for c in plan.candidates if c.strategy == "ps")
    assert ways == [1, 2, 4] and plan.strategy != "ps"
    ddp = memory_estimate(desc, "ddp", world=8, batch=32, optimizer="adam")
    ps = memory_estimate(desc, "ps", world=8, batch=32, optimizer="adam", stages=2)
    assert ps.optimizer == pytest.approx(ddp.optimizer / 2) and ps.params == ddp.params


def test_uniform_hosts_favour_the_ring() -> None:
    hosts = _hosts(4)
    ring = samples_per_s("ddp", hosts, batch=32, grad_bytes=MODEL, weight_bytes=MODEL,
                         latency_us=50.0)  # fmt: skip
    sync = samples_per_s("ps", hosts, batch=32, grad_bytes=MODEL, weight_bytes=MODEL,
                         latency_us=50.0, servers=1)  # fmt: skip
    asyn = samples_per_s("ps", hosts, batch=32, grad_bytes=MODEL, weight_bytes=MODEL,
                         latency_us=50.0, servers=1, mode="async")  # fmt: skip
    # Ring: 0.1 s + 2 x 3/4 x 0.8 s = 1.3 s for 4 x 32 samples.
    assert ring_step_s(hosts, MODEL, 50.0) == pytest.approx(0.1 + 1.2 + 6 * 50e-6)
    assert ring == pytest.approx(4 * 32 / (1.3 + 300e-6))
    # Sync PS: 0.1 s + 3 x 0.8 s each way through the one server's link.
    assert ps_sync_step_s(hosts[1:], hosts[:1], MODEL, MODEL, 50.0) == pytest.approx(
        0.1 + 4.8 + 100e-6
    )
    # Async: the server's link caps the updates at 0.125 GB/s / 100 MB = 1.25 per second.
    assert asyn == pytest.approx(1.25 * 32)
    assert ring > 3 * sync and ring > asyn


def test_a_straggler_favours_async_parameter_servers() -> None:
    # Compute-bound (a small model): one host's steps are 4x slower.
    small = 1e6 * 4
    hosts = _hosts(4, compute_s=0.1)
    hosts[3] = HostRates(compute_s=0.4, bw_gbs=GBIT)

    def rate(strategy: str, **kw: object) -> float:
        return samples_per_s(strategy, hosts, batch=32, grad_bytes=small, weight_bytes=small,
                             latency_us=50.0, **kw)  # type: ignore[arg-type]  # fmt: skip

    ring, sync = rate("ddp"), rate("ps", servers=1)
    asyn, bounded = rate("ps", servers=1, mode="async"), rate("ps", servers=1, mode="async",
                                                             max_staleness=2)  # fmt: skip
    # Ring and sync PS wait for the straggler every step; async PS does not.
    assert ring == pytest.approx(4 * 32 / (0.4 + 1.5 * small / 0.125e9 + 300e-6))
    cycle = (small + small) / 0.125e9 + 100e-6
    assert asyn == pytest.approx(32 * (2 / (0.1 + cycle) + 1 / (0.4 + cycle)))
    assert asyn > ring > sync
    # A staleness bound makes everyone wait for the straggler in the long run.
    assert bounded == pytest.approx(3 * 32 / (0.4 + cycle))


def test_the_straggler_model_refuses_what_it_does_not_cover() -> None:
    with pytest.raises(UsageError, match="not 'fsdp'"):
        samples_per_s("fsdp", _hosts(2), batch=1, grad_bytes=1, weight_bytes=1, latency_us=0)
    with pytest.raises(UsageError, match="servers"):
        samples_per_s("ps", _hosts(2), batch=1, grad_bytes=1, weight_bytes=1, latency_us=0)
