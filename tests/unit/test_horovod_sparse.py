"""hvd.sparse_allreduce_async in one process: the layout rule, the result, bad input."""

from __future__ import annotations

import pytest
import torch

import manygpu.horovod as hvd
from manygpu.errors import UsageError
from manygpu.horovod.sparse import _sparse_dim


def test_sparse_dim_is_read_back_from_the_counts() -> None:
    shape = torch.Size([10, 3])
    assert _sparse_dim(shape, n_indices=4, n_values=12) == 1  # 4 rows of 3
    assert _sparse_dim(shape, n_indices=8, n_values=4) == 2  # 4 single elements
    with pytest.raises(UsageError, match="different sparse dimensions"):
        _sparse_dim(shape, n_indices=5, n_values=12)


def test_one_process_result_is_the_tensor_kept_sparse(one: None) -> None:
    t = torch.tensor([[0.0, 2.0], [0.0, 0.0], [3.0, 0.0]]).to_sparse()
    handle = hvd.sparse_allreduce_async(t, name="t", op=hvd.Average)
    assert isinstance(handle, int)  # an ordinary handle for poll and synchronize
    assert hvd.poll(handle)
    result = handle()  # Horovod calls it
    assert result.is_sparse and torch.equal(result.to_dense(), t.to_dense())
    again = hvd.synchronize(hvd.sparse_allreduce_async(t, name="t2", op=hvd.Sum))
    assert again.is_sparse and torch.equal(again.to_dense(), t.to_dense())


def test_bad_input_is_one_clear_error(one: None) -> None:
    t = torch.eye(3).to_sparse()
    with pytest.raises(UsageError, match=r"op must be hvd\.Average or hvd\.Sum, not hvd\.Max"):
        hvd.sparse_allreduce_async(t, name="t", op=hvd.Max)
    with pytest.raises(UsageError, match=r"needs a sparse COO tensor.*hvd\.allreduce"):
        hvd.sparse_allreduce_async(torch.eye(3), name="t", op=hvd.Average)
    assert "sparse_allreduce_async" not in hvd.LEFT_OUT
