"""Step time and scaling efficiency from an alpha-beta model of ring collectives.

Ring all-reduce of S bytes over N ranks on a link of latency alpha and
bandwidth B (Patarasuk & Yuan 2009; Thakur et al. 2005):

    T(S) = 2 (N - 1) alpha + 2 (N - 1) / N * S / B

and all-gather / reduce-scatter take half of that. Gradients are reduced in
k buckets (DDP: 25 MB; Horovod's tensor fusion: 64 MB) as backward produces
them, so communication hides behind the backward still to run. With backward
time b, bucket time t and T = k t in all, the first bucket is ready after b / k
and the last only when backward ends, so

    exposed = max(0, T - t - b (k - 1) / k) + t

(the last bucket is always exposed). Forward is 1/3 and backward 2/3 of the
compute (backward computes two products per forward one). Where communication
cannot run beside compute (CPU processes: gloo's threads need the same cores),
all of it is exposed. One formula for every case; only the inputs change.

Compute is the model's FLOPs at the rate the device achieves in training at
the step's precision (:mod:`.devices`), or a measured step time when the
model description has one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from manygpu.errors import UsageError
from manygpu.plan.desc import ModelDesc
from manygpu.plan.devices import resolve_precision
from manygpu.plan.hardware import Cluster
from manygpu.plan.memory import bytes_per_param, element_bytes
from manygpu.strategies.costs import CommModel
from manygpu.strategies.pipeline.schedules import bubble_fraction
from manygpu.strategies.registry import card

BACKWARD_FRACTION = 2.0 / 3.0


def ring_allreduce_s(nbytes: float, ranks: int, bw_gbs: float, latency_us: float) -> float:
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps * latency_us * 1e-6 + steps / ranks * nbytes / (bw_gbs * 1e9)


def ring_gather_s(nbytes: float, ranks: int, bw_gbs: float, latency_us: float) -> float:
    """All-gather (or reduce-scatter) whose full result is ``nbytes``."""
    return ring_allreduce_s(nbytes, ranks, bw_gbs, latency_us) / 2


def push_pull_s(
    grad_bytes: float,
    weight_bytes: float,
    workers: int,
    servers: int,
    bw_gbs: float,
    latency_us: float,
) -> float:
    """One synchronous parameter-server exchange: every worker pushes, then pulls.

    Each worker sends its whole gradient (``grad_bytes``, split over the
    servers) and receives the whole model; each server's link carries
    ``workers / servers`` of them. Both phases wait for the busier end:

        T = (max(G, W G / K) + max(P, W P / K)) / B + 2 alpha
    """
    busiest = max(1.0, workers / servers)
    return (grad_bytes + weight_bytes) * busiest / (bw_gbs * 1e9) + 2 * latency_us * 1e-6


def all_to_all_s(nbytes: float, ranks: int, bw_gbs: float, latency_us: float) -> float:
    """An all-to-all in which each rank holds ``nbytes`` for all ranks (``1/ranks`` of
    it its own): ``ranks - 1`` pairwise exchanges, ``(ranks - 1) / ranks`` of it sent."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return (ranks - 1) * latency_us * 1e-6 + (ranks - 1) / ranks * nbytes / (bw_gbs * 1e9)


def token_all_to_all_bytes(desc: ModelDesc, batch: int, precision: str) -> float:
    """What one device holds for one of a MoE layer's all-to-alls: each of its
    ``batch x seq`` tokens' ``top-k`` routed copies of ``hidden`` activations."""
    copies = batch * desc.seq_len * desc.experts_per_token
    return copies * desc.hidden * element_bytes(precision)


def exposed_s(chunk_s: float, chunks: int, window_s: float, overlap: bool) -> float:
    """Communication left on the critical path (the formula in the module docstring)."""
    total = chunk_s * chunks
    if not overlap or chunks == 0:
        return total
    hideable = window_s * (chunks - 1) / chunks
    return max(0.0, total - chunk_s - hideable) + chunk_s


@dataclass(frozen=True, kw_only=True)
class StepEstimate:
    """One strategy's predicted step on a cluster."""

    strategy: str
    world: int
    replica_devices: int
    """Devices holding one model replica (pipeline / tensor ways; 1 otherwise)."""
    batch: int
    """Samples per model replica per step (devices per replica x the per-device batch)."""
    compute_s: float
    """The replica's compute time per step (bubbles included for pipelines)."""
    comm_s: float
    """All communication per step, hidden or not."""
    exposed_s: float
    ideal_s: float
    """One device's compute for the batch / replica devices: perfect scaling."""
    servers: int = 0
    """Devices that serve parameters and train no replica (parameter servers)."""
    all_to_all_s: float = 0.0
    """Expert parallelism: seconds of the routed tokens' all-to-alls (part of ``comm_s``,
    all exposed: the next layer waits for them)."""
    all_to_all_bytes: float = 0.0
    """Expert parallelism: bytes one device sends in them per step."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s

    @property
    def efficiency(self) -> float:
        """Throughput / (world x one device's throughput)."""
        return self.ideal_s / self.step_s * (self.world - self.servers) / self.world

    @property
    def samples_per_s(self) -> float:
        return (self.world - self.servers) // self.replica_devices * self.batch / self.step_s


def _buckets(nbytes: float, bucket_mb: float) -> tuple[int, float]:
    k = max(1, math.ceil(nbytes / (bucket_mb * 1e6)))
    return k, nbytes / k


def estimate(
    desc: ModelDesc,
    cluster: Cluster,
    strategy: str,
    *,
    batch: int,
    precision: str = "fp32",
    world: int | None = None,
    stages: int = 1,
    microbatches: int = 0,
    schedule: str = "1f1b",
    virtual_stages: int = 0,
    mfu: float | None = None,
    bucket_mb: float = 25.0,
    grad_bytes: float | None = None,
) -> StepEstimate:
    """Predict a step of ``strategy`` on ``world`` devices (default: the whole cluster).

    ``batch`` is samples per device per step, so every strategy trains the same
    global batch (world x batch) and their throughputs compare fairly.

    ``precision``: fp32, tf32, bf16, fp16 or auto (the device's best).
    ``mfu``: assume this fraction of the device's peak instead of its
    achievable rates. ``grad_bytes`` per parameter on the wire defaults to the
    precision's (4 in fp32 / tf32; 2 when gradients are 16-bit); torch's
    autocast keeps fp32 gradients, so pass 4 for it. ``stages``: pipeline or
    tensor ways; ``schedule`` and ``virtual_stages``: a pipeline's (its bubble,
    :func:`manygpu.strategies.pipeline.schedules.bubble_fraction`).
    """
    n = cluster.world_size if world is None else world
    if card(strategy).comm.grads == "push_pull":  # `stages` counts the servers
        return _parameter_server(desc, cluster, strategy, n, stages, batch, precision, mfu,
                                 grad_bytes)  # fmt: skip
    if n < 1 or batch < 1 or stages < 1 or n % stages:
        raise UsageError(f"need world >= 1 divisible by stages >= 1, got {n} and {stages}")
    model = card(strategy).comm
    # `batch` is per device: a pipeline / tensor replica of `stages` devices takes stages x batch.
    replica = batch * stages if model.replica == "ways" else batch
    precision = resolve_precision(precision, cluster.device)
    one = desc.compute_s(replica, cluster.tflops(precision, "matmul", mfu),
                         cluster.tflops(precision, "conv", mfu))  # fmt: skip
    gb = bytes_per_param(precision, "sgd")
    grad = desc.parameters * (gb.compute if grad_bytes is None else grad_bytes)
    if model.replica == "one_process":
        return StepEstimate(
            strategy=strategy, world=n, replica_devices=n, batch=batch, compute_s=one,
            comm_s=0.0, exposed_s=0.0, ideal_s=one / n,
        )  # fmt: skip
    if model.split != "none":
        m = microbatches or min(4 * stages, replica)  # micro-batches of at least one sample
        bubble = bubble_fraction(schedule, stages, m, virtual_stages)
        return _model_parallel(desc, cluster, strategy, one, n, stages, replica, bubble,
                               grad / stages, bucket_mb, precision)  # fmt: skip
    if model.token_all_to_alls:
        per_param = gb.compute if grad_bytes is None else grad_bytes
        return _expert_parallel(desc, cluster, strategy, one, n, stages, batch, per_param,
                                precision, bucket_mb)  # fmt: skip
    comm, exposed = _data_parallel(model, cluster, n, one, grad, desc.parameters * gb.compute,
                                   bucket_mb)  # fmt: skip
    return StepEstimate(
        strategy=strategy, world=n, replica_devices=1, batch=batch, compute_s=one,
        comm_s=comm, exposed_s=exposed, ideal_s=one,
    )  # fmt: skip


def _data_parallel(
    model: CommModel,
    cluster: Cluster,
    n: int,
    one: float,
    grad: float,
    weights: float,
    bucket_mb: float,
) -> tuple[float, float]:
    """(all, exposed) seconds of a data-parallel step: gradients in k buckets,
    weight gathers before forward (and again before backward), ZeRO-1's gather after."""
    bw, lat = cluster.ring_link(n)
    fwd, bwd = one * (1 - BACKWARD_FRACTION), one * BACKWARD_FRACTION
    k, chunk = _buckets(grad, bucket_mb)
    if model.grads == "all_reduce":
        grads = ring_allreduce_s(chunk, n, bw, lat)
    else:
        grads = ring_gather_s(chunk, n, bw, lat) if model.grads == "reduce_scatter" else 0.0
    gather = ring_gather_s(weights / k, n, bw, lat)
    comm = k * (grads + model.weight_gathers * gather)
    in_backward = grads + (gather if model.weight_gathers >= 2 else 0.0)
    exposed = exposed_s(in_backward, k, bwd, cluster.overlap)
    if model.weight_gathers >= 1:
        exposed += exposed_s(gather, k, fwd, cluster.overlap)
    if model.gather_after_step:  # the updated shards, gathered after the optimizer step
        whole = ring_gather_s(weights, n, bw, lat)
        comm, exposed = comm + whole, exposed + whole
    return comm, exposed


def _model_parallel(
    desc: ModelDesc,
    cluster: Cluster,
    strategy: str,
    one: float,
    n: int,
    ways: int,
    batch: int,
    bubble: float,
    stage_grad: float,
    bucket_mb: float,
    precision: str,
) -> StepEstimate:
    """Pipeline (its schedule's ``bubble``, idle over busy) or tensor (Megatron's 4
    all-reduces per layer), then DP."""
    dp = n // ways
    if card(strategy).comm.split == "stages":
        compute = one / ways * (1 + bubble)
        inner = 0.0  # point-to-point activations between stages: small, not modelled
    else:
        if not (desc.layers and desc.hidden and desc.seq_len):
            raise UsageError(
                "tensor parallelism needs the model's layers, hidden size and sequence"
            )
        act = batch * desc.seq_len * desc.hidden * element_bytes(precision)
        bw, lat = cluster.ring_link(ways)
        inner = 4 * desc.layers * ring_allreduce_s(act, ways, bw, lat)
        compute = one / ways
    bw, lat = cluster.ring_link(n)
    k, chunk = _buckets(stage_grad, bucket_mb)
    ar = ring_allreduce_s(chunk, dp, bw, lat)
    exposed = inner + exposed_s(ar, k, compute * BACKWARD_FRACTION, cluster.overlap)
    return StepEstimate(
        strategy=strategy, world=n, replica_devices=ways, batch=batch, compute_s=compute,
        comm_s=inner + k * ar, exposed_s=exposed, ideal_s=one / ways,
    )  # fmt: skip


def _expert_parallel(
    desc: ModelDesc, cluster: Cluster, strategy: str, one: float, n: int, ep: int, batch: int,
    per_param: float, precision: str, bucket_mb: float,
) -> StepEstimate:  # fmt: skip
    """Expert parallelism (every device trains its own batch): the routed tokens'
    all-to-alls over ``ep`` on the critical path, then the gradients in buckets
    behind the backward: the replicated parameters' over all ``n`` devices, each
    expert slice's over its ``n / ep`` replicas."""
    if not (desc.routed_layers and desc.hidden and desc.seq_len):
        raise UsageError(
            "expert parallelism needs the model's experts, layers, hidden size and sequence"
        )
    held = token_all_to_all_bytes(desc, batch, precision)
    calls = card(strategy).comm.token_all_to_alls * desc.routed_layers
    bw, lat = cluster.ring_link(ep)
    a2a = calls * all_to_all_s(held, ep, bw, lat)
    bw, lat = cluster.ring_link(n)
    dense_k, dense = _buckets((desc.parameters - desc.expert_parameters) * per_param, bucket_mb)
    expert_k, expert = _buckets(desc.expert_parameters / ep * per_param, bucket_mb)
    total = dense_k * ring_allreduce_s(dense, n, bw, lat)
    total += expert_k * ring_allreduce_s(expert, n // ep, bw, lat)
    chunks = dense_k + expert_k
    hidden = exposed_s(total / chunks, chunks, one * BACKWARD_FRACTION, cluster.overlap)
    return StepEstimate(
        strategy=strategy, world=n, replica_devices=1, batch=batch, compute_s=one,
        comm_s=total + a2a, exposed_s=hidden + a2a, ideal_s=one, all_to_all_s=a2a,
        all_to_all_bytes=calls * held * (ep - 1) / ep,
    )  # fmt: skip


def _parameter_server(
    desc: ModelDesc,
    cluster: Cluster,
    strategy: str,
    n: int,
    servers: int,
    batch: int,
    precision: str,
    mfu: float | None,
    grad_bytes: float | None,
) -> StepEstimate:
    """Sync parameter servers: ``servers`` of the ``n`` devices serve, the rest train.

    The exchange (:func:`push_pull_s`) starts after the backward and the next
    step waits for the weights: none of it is hidden. Weights travel in fp32
    (the servers keep fp32 parameters; mixed precision is autocast).
    """
    if not 1 <= servers < n or batch < 1:
        raise UsageError(f"parameter servers need 1 <= servers < world, got {servers} of {n}")
    precision = resolve_precision(precision, cluster.device)
    one = desc.compute_s(batch, cluster.tflops(precision, "matmul", mfu),
                         cluster.tflops(precision, "conv", mfu))  # fmt: skip
    gb = bytes_per_param(precision, "sgd")
    grad = desc.parameters * (gb.compute if grad_bytes is None else grad_bytes)
    bw, lat = cluster.ring_link(n)
    comm = push_pull_s(grad, desc.parameters * 4.0, n - servers, servers, bw, lat)
    return StepEstimate(
        strategy=strategy, world=n, replica_devices=1, batch=batch, compute_s=one,
        comm_s=comm, exposed_s=comm, ideal_s=one, servers=servers,
    )  # fmt: skip
