"""manygpu.horovod in one process: the pure parts, bad input, and the world-of-one paths."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import manygpu.horovod as hvd
from manygpu.errors import UsageError
from manygpu.horovod.basics import backend_for, cross_of
from manygpu.horovod.buckets import plan_buckets, split_even
from manygpu.horovod.data_ops import send_splits
from manygpu.horovod.reduce_ops import resolve_op, scatter_counts
from manygpu.horovod.reports import describe_stall, layout_diff, render_mismatch


# -- pure functions ----------------------------------------------------------------
def test_backend_is_gloo_on_cpu_and_nccl_for_cuda_tensors() -> None:
    assert backend_for(False) == "gloo"
    assert backend_for(True) == "cpu:gloo,cuda:nccl"


def test_cross_ranks_follow_local_ranks_across_hosts() -> None:
    # 2 hosts x 2 processes: ranks 0,1 on host 0; 2,3 on host 1.
    table = [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [cross_of(table, r) for r in range(4)] == [
        (0, 2, True),
        (0, 2, True),
        (1, 2, True),
        (1, 2, True),
    ]
    # Uneven hosts: host 1 runs one process; local rank 1 exists only on host 0.
    uneven = [(0, 0), (1, 0), (0, 1)]
    assert cross_of(uneven, 1) == (0, 1, False)
    assert cross_of(uneven, 2) == (1, 2, False)


def test_buckets_close_at_the_cap_and_where_the_dtype_changes() -> None:
    sizes = [400, 400, 400, 400, 4000, 10]
    keys = ["f32"] * 5 + ["f16"]
    # As DDP's: a bucket closes once it reaches the cap, the item that reached it included.
    assert plan_buckets(sizes, keys, cap_bytes=800) == [[0, 1], [2, 3], [4], [5]]
    assert plan_buckets(sizes, keys, cap_bytes=1000) == [[0, 1, 2], [3, 4], [5]]
    assert plan_buckets(sizes, keys, cap_bytes=10**6) == [[0, 1, 2, 3, 4], [5]]
    assert plan_buckets([], [], cap_bytes=1) == []
    # A classifier's large first linear layer travels with the small layers after it,
    # not at the head of a bucket that waits for the rest of backward (demo-cnn, reversed).
    cnn = [40, 5120, 512, 1179648, 256, 73728, 128, 1152]
    assert plan_buckets(cnn, ["f32"] * 8, cap_bytes=1 << 20) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_even(5, 2) == [[0, 1, 2], [3, 4]]
    assert split_even(2, 5) == [[0], [1]]


def test_reducescatter_counts_give_the_first_ranks_more() -> None:
    assert scatter_counts(7, 3) == [3, 2, 2]
    assert scatter_counts(6, 3) == [2, 2, 2]
    assert scatter_counts(1, 3) == [1, 0, 0]


def test_alltoall_splits_are_checked() -> None:
    assert send_splits(6, None, 3) == [2, 2, 2]
    assert send_splits(6, torch.tensor([1, 0, 5]), 3) == [1, 0, 5]
    for bad in ([1, 2], [3, 4, -1], [1, 1, 1]):
        with pytest.raises(UsageError, match="must have 3 non-negative entries summing to"):
            send_splits(6, bad, 3)
    with pytest.raises(UsageError, match="divisible by the number of processes"):
        send_splits(7, None, 3)


def test_reduce_ops_and_the_deprecated_average_flag() -> None:
    assert resolve_op(None, None) is hvd.Average
    assert resolve_op(hvd.Max, None) is hvd.Max
    with pytest.warns(DeprecationWarning, match="op=hvd.Average"):
        assert resolve_op(None, False) is hvd.Sum
    with pytest.raises(UsageError, match="not both"):
        resolve_op(hvd.Sum, True)
    with pytest.raises(UsageError, match=r"unknown reduce op 9; choose one of hvd\.Average"):
        resolve_op(9, None)
    with pytest.raises(
        hvd.NotSupportedError, match=r"hvd\.Adasum \(Adasum reduction\) .* use op=hvd\.Average"
    ):
        resolve_op(2, None)
    # Horovod raises a RuntimeError for an op its build lacks; scripts catch that.
    with pytest.raises(RuntimeError, match="Adasum"):
        resolve_op(hvd.Adasum, None)


def test_layout_differences_are_named() -> None:
    a = [("w", (2, 3), "torch.float32"), ("b", (2,), "torch.float32")]
    b = [("w", (2, 4), "torch.float32"), ("b", (2,), "torch.float16")]
    c = [("w", (2, 3), "torch.float32")]
    assert layout_diff([a, b, a]) == (
        "'w' is float32[2x3] on ranks 0, 2, float32[2x4] on rank 1; "
        "'b' is float32[2] on ranks 0, 2, float16[2] on rank 1"
    )
    assert layout_diff([a, c]) == "'b' exists only on rank 0"
    assert layout_diff([a, a[::-1]]) == "the same tensors in a different order on rank 0 vs rank 1"


def test_mismatch_lines_group_ranks_by_call() -> None:
    rows = [
        ("allreduce(float32[4])", None),
        ("allreduce(float32[8])", None),
        ("allreduce(float32[4])", None),
    ]
    text = render_mismatch(rows, "fallback")
    assert "ranks 0, 2 call allreduce(float32[4]); rank 1 calls allreduce(float32[8])" in text
    # Same call everywhere: the ranks differ in call numbers; comm.debug's message says so.
    assert (
        render_mismatch([("x", None), ("x", None)], "call numbers differ") == "call numbers differ"
    )


def test_stall_names_missing_and_elsewhere_ranks() -> None:
    records = {0: (5, "allreduce('a')"), 2: (5, "allreduce('a')"), 3: (4, "broadcast('p')")}
    assert describe_stall(records, 4, 5) == (
        "missing ranks: [1] never started this collective; "
        "rank 3 is stuck in its own call #4 broadcast('p'); ranks 0, 2 waited in it"
    )


def test_compression_fp16_halves_floats_and_restores_dtype() -> None:
    x = torch.tensor([1.0, 2.5], dtype=torch.float64)
    sent, ctx = hvd.Compression.fp16.compress(x)
    assert sent.dtype == torch.float16
    back = hvd.Compression.fp16.decompress(sent, ctx)
    assert back.dtype == torch.float64 and back.tolist() == [1.0, 2.5]
    ints, ctx = hvd.Compression.fp16.compress(torch.tensor([3]))
    assert ints.dtype == torch.int64 and hvd.Compression.fp16.decompress(ints, ctx).tolist() == [3]
    same, ctx = hvd.Compression.none.compress(x)
    assert same is x and hvd.Compression.none.decompress(same, ctx) is x


# -- what is left out ------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(hvd.LEFT_OUT))
def test_left_out_names_say_what_to_use(name: str) -> None:
    with pytest.raises(
        hvd.NotSupportedError,
        match=rf"^hvd\.{name} \(.+\) is not supported by manygpu\.horovod; use \S",
    ):
        getattr(hvd, name)


def test_unknown_names_are_plain_attribute_errors() -> None:
    assert not hasattr(hvd, "no_such_function")
    with pytest.raises(AttributeError):
        hvd.no_such_function  # noqa: B018


def test_before_init_sizes_are_refused() -> None:
    assert not hvd.is_initialized()
    with pytest.raises(UsageError, match=r"has not been initialized; call hvd.init\(\) first"):
        hvd.size()
    with pytest.raises(UsageError, match="not been initialized"):
        hvd.DistributedOptimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


def test_init_refuses_communicators_and_bad_process_sets() -> None:
    with pytest.raises(UsageError, match=r"hvd.init\(comm=...\) is not supported"):
        hvd.init(comm=[0, 1])
    with pytest.raises(UsageError, match=r"give a list of hvd.ProcessSet or 'dynamic'"):
        hvd.init(process_sets="static")
    assert not hvd.is_initialized()  # a refused init leaves no job behind


def test_process_sets_check_their_ranks_and_registration(one: None) -> None:
    assert (
        str(hvd.ProcessSet([2, 0]))
        == "ProcessSet(process_set_id=None, ranks=[0, 2], mpi_comm=None)"
    )
    for bad in ([], [0, 0], [-1], "01", 3):
        with pytest.raises(UsageError, match="ProcessSet"):
            hvd.ProcessSet(bad)  # type: ignore[arg-type]
    assert hvd.global_process_set.ranks == [0] and hvd.global_process_set.size() == 1
    with pytest.raises(UsageError, match="HOROVOD_DYNAMIC_PROCESS_SETS=1"):
        hvd.add_process_set([0])
    with pytest.raises(UsageError, match=r"is not registered"):
        hvd.allreduce(torch.ones(1), process_set=hvd.ProcessSet([0]))
    with pytest.raises(UsageError, match=r"must be a hvd\.ProcessSet"):
        hvd.allreduce(torch.ones(1), process_set=[0])


# -- a world of one ------------------------------------------------------------------------
def test_one_process_answers_like_horovod(one: None) -> None:
    assert (hvd.size(), hvd.rank(), hvd.local_size(), hvd.local_rank()) == (1, 0, 1, 0)
    assert (hvd.cross_size(), hvd.cross_rank(), hvd.is_homogeneous()) == (1, 0, True)
    x = torch.tensor([1.0, 4.0])
    assert hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5).tolist() == [
        1.0,
        4.0,
    ]
    assert hvd.allgather(x).tolist() == [1.0, 4.0]
    assert hvd.reducescatter(x.reshape(2, 1)).tolist() == [[1.0], [4.0]]
    out, received = hvd.alltoall(x, splits=[2])
    assert out.tolist() == [1.0, 4.0] and received.tolist() == [2]
    assert hvd.broadcast_object("o", root_rank=0) == "o" and hvd.allgather_object(1) == [1]
    assert hvd.join() == 0
    hvd.barrier()
    leaf = torch.ones(2, requires_grad=True)  # in place on a leaf that requires grad
    assert hvd.allreduce_(leaf, prescale_factor=3.0) is leaf and leaf.tolist() == [3.0, 3.0]
    handle = hvd.allreduce_async(x)
    assert hvd.poll(handle) and hvd.synchronize(handle).tolist() == [1.0, 4.0]
    with pytest.raises(UsageError, match="unknown handle"):
        hvd.poll(handle)


def test_bad_arguments_are_one_line_errors(one: None) -> None:
    x = torch.ones(4)
    with pytest.raises(UsageError, match="root_rank=3 is not a rank of this job"):
        hvd.broadcast(x, 3)
    with pytest.raises(UsageError, match="needs a numeric tensor"):
        hvd.allreduce(torch.ones(2, dtype=torch.bool), prescale_factor=2.0)
    with pytest.raises(UsageError, match="needs a contiguous tensor"):
        hvd.allreduce_(torch.ones(4, 2).t())
    with pytest.raises(UsageError, match=r"process_set must be a hvd\.ProcessSet"):
        hvd.allreduce(x, process_set=object())
    with pytest.raises(UsageError, match="invalid params of type int"):
        hvd.broadcast_parameters(3, root_rank=0)
    with pytest.raises(UsageError, match=r"cannot broadcast torch\.optim\.LBFGS state"):
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(nn.Linear(2, 2).parameters()), 0)


def _model_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"op": hvd.Max}, "op must be hvd.Average or hvd.Sum, not Max"),
        (
            {"op": hvd.Sum, "gradient_predivide_factor": 2.0},
            "gradient_predivide_factor needs op=hvd.Average",
        ),
        ({"backward_passes_per_step": 0}, "backward_passes_per_step must be an integer >= 1"),
        ({"named_parameters": [1, 2]}, "should be a sequence of tuples"),
        ({"named_parameters": [("a", None), ("a", None)]}, r"must be unique; duplicates: \['a'\]"),
        ({"named_parameters": []}, "4 of the optimizer's parameters are not in it"),
    ],
)
def test_distributed_optimizer_bad_input(one: None, kwargs: dict, words: str) -> None:
    _, opt = _model_opt()
    with pytest.raises(UsageError, match=words):
        hvd.DistributedOptimizer(opt, **kwargs)


def test_distributed_optimizer_alone_is_the_optimizer(one: None) -> None:
    """One process: the same updates as the plain optimizer, Horovod's class and warnings."""
    model, opt = _model_opt()
    ref_model, ref_opt = _model_opt()
    opt.step()  # state carried over by the wrapping (Horovod would lose it)
    ref_opt.step()
    wrapped = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    assert isinstance(wrapped, torch.optim.SGD) and type(wrapped).__name__ == "SGD"
    x = torch.randn(8, 3)
    for m, o in ((model, wrapped), (ref_model, ref_opt)):
        m(x).square().mean().backward()
        o.step()
        o.zero_grad()
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b)
    model(x).sum().backward()
    wrapped.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with wrapped.skip_synchronize():
            wrapped.step()
        assert not caught
        wrapped.synchronize()
        wrapped.step()  # after synchronize() without skip_synchronize(): Horovod's warning
        assert any("skip_synchronize" in str(w.message) for w in caught)
    with pytest.raises(UsageError, match="already a DistributedOptimizer"):
        hvd.DistributedOptimizer(wrapped)
    wrapped.set_backward_passes_per_step(3)
    assert wrapped.backward_passes_per_step == 3


def test_groups_choose_the_buckets(one: None) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))  # weight, bias, weight, bias
    params = list(model.parameters())

    def buckets(**kwargs: object) -> list[list[int]]:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return hvd.DistributedOptimizer(opt, **kwargs)._hvd.buckets  # type: ignore[attr-defined]

    # Indices are in reverse parameter order: 0 is the last layer's bias.
    assert buckets() == [[0, 1, 2, 3]]
    assert buckets(num_groups=2) == [[0, 1], [2, 3]]
    assert buckets(groups=[[params[0], params[1]]]) == [[0], [1], [2, 3]]
    assert buckets(bucket_cap_mb=1e-5) == [[0, 1], [2], [3]]  # 10 bytes: 8 + 32, 16, 48
    assert buckets(bucket_cap_mb=1e-6) == [[0], [1], [2], [3]]
    model[1].double()  # a group is one flat tensor: split where the dtype changes
    assert buckets(num_groups=1) == [[0, 1], [2, 3]]


@pytest.mark.usefixtures("one")
def test_the_optimizer_keeps_horovods_parameter_names_attribute() -> None:
    """``optimizer._parameter_names`` (parameter -> name), as Horovod's has: scripts read it."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters()}]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    names = opt._parameter_names
    assert set(names) == set(model.parameters()) and len(set(names.values())) == 4
    named = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    assert named._parameter_names[model[1].bias] == "1.bias"
