"""Iterable datasets in one process: the split's arithmetic, refusals, exact resume.

Loader workers and ranks are real processes: tests/launch/test_streams_launch.py.
Here every reader of the fallback split is simulated by calling :func:`blocks`
with its (rank, worker).
"""

from __future__ import annotations

import datetime as dt
import functools
import gc
import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import stream_job
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
from torch.utils.data._utils import worker as torch_worker

from manygpu import Parallel
from manygpu.checkpoint.resumed import position
from manygpu.core.data import worker_start
from manygpu.core.streams import (
    BlockSplit,
    PreparedStream,
    Reader,
    _fingerprint,
    blocks,
    prepare_stream,
    read_whole,
)
from manygpu.errors import UsageError

N, BATCH, WORKERS = 1003, 8, 2


def _steps(world: int, skip: int = 0, complete_only: bool = True) -> list[list[list[int]]]:
    """Per rank, its batches in the order its loader hands them out (workers in turn)."""
    per_rank = []
    for rank in range(world):
        per_worker = []
        for worker in range(WORKERS):
            ids = list(
                blocks(range(N), Reader(rank, world, worker, WORKERS), BATCH, skip, complete_only)
            )
            per_worker.append([ids[i : i + BATCH] for i in range(0, len(ids), BATCH)])
        turns = max(len(w) for w in per_worker)
        per_rank.append([w[t] for t in range(turns) for w in per_worker if t < len(w)])
    return per_rank


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fallback_split_is_one_process_global_batches_minus_the_tail(world: int) -> None:
    ranks = _steps(world)
    global_batch = world * BATCH
    kept = N - N % global_batch  # the last N % (world * batch) samples are dropped
    assert all(len(r) == kept // global_batch for r in ranks)  # equal steps, no talk
    for step in range(kept // global_batch):
        glued = [i for r in ranks for i in r[step]]
        assert glued == list(range(step * global_batch, (step + 1) * global_batch))
    evaluation = _steps(world, complete_only=False)  # evaluation keeps the tail
    assert sorted(i for r in evaluation for b in r for i in b) == list(range(N))


@pytest.mark.parametrize(("saved", "now"), [(2, 2), (2, 3), (3, 1)])
def test_fallback_resume_starts_where_the_checkpoint_position_maps(saved: int, now: int) -> None:
    """The real path: the Checkpointer's position() (whole new global batches), then
    PreparedStream.set_epoch; what does not make a whole new global batch is read again."""
    done = 17 * saved * BATCH  # what the checkpoint's position says was read
    where = position({"epoch": 4, "batches": 17, "world": saved, "batch_size": BATCH},
                     world=now, batch=BATCH)  # fmt: skip
    ranks = []
    for rank in range(now):
        split = BlockSplit(range(N), rank, now, BATCH)
        prepared = PreparedStream(DataLoader(split, batch_size=BATCH), torch.device("cpu"))
        prepared.set_epoch(where.epoch, where.batches)
        ranks.append([b.tolist() for b in prepared])
        assert prepared.state_dict() == {"epoch": 5, "batches": 0}  # the epoch ran out
    assert where.sample + where.early == done and where.sample > done - now * BATCH
    step = now * BATCH
    assert len(ranks[0]) == (N - where.sample) // step
    for k in range(len(ranks[0])):
        glued = [i for r in ranks for i in r[k]]
        assert glued == list(range(where.sample + k * step, where.sample + (k + 1) * step))


class _OneShot(IterableDataset):
    def __init__(self) -> None:
        self.items = iter(range(10))

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        return next(self.items)


@pytest.mark.parametrize(
    ("loader", "says"),
    [
        (DataLoader(_OneShot(), batch_size=2), "is an iterator"),
        (DataLoader(stream_job.Numbers(10), batch_size=None), "needs batch_size="),
        (
            DataLoader(
                stream_job.Numbers(10), batch_size=2, num_workers=1, persistent_workers=True
            ),
            "persistent_workers",
        ),
    ],
    ids=["one-shot", "no-batch-size", "persistent-workers"],
)
def test_streams_that_cannot_be_split_are_refused_in_one_line(
    loader: DataLoader, says: str
) -> None:
    with Parallel(strategy="single") as par, pytest.raises(UsageError, match=says) as info:
        par.prepare(loader)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kind", ["torch", "hf"])
def test_resume_mid_epoch_reads_what_an_uninterrupted_run_reads(kind: str, tmp_path: Path) -> None:
    def run(directory: Path, total: int, every: int) -> dict[int, list[int]]:
        with Parallel(strategy="single") as par:
            return stream_job.train(par, kind, directory, total, every=every, batch=64, workers=0)

    reference = run(tmp_path / "ref", 24, 0)  # two epochs of 15 or so steps
    run(tmp_path / "ck", 21, 5)  # "dies" after step 21, saved at 20 (second epoch)
    resumed = run(tmp_path / "ck", 24, 5)
    assert min(resumed) == 21
    assert all(resumed[s] == reference[s] for s in resumed)
    assert reference[1] != reference[1 + 15]  # the second epoch has its own order


def test_a_sharded_stream_resumed_on_another_batch_size_or_worker_count_is_refused(
    tmp_path: Path,
) -> None:
    """Shards replay the batches taken: another batch size, or another number of
    loader workers (Hugging Face deals its shards by it), would read other samples."""

    def run(kind: str, batch: int, workers: int = 0) -> dict[int, list[int]]:
        with Parallel(strategy="single") as par:
            return stream_job.train(
                par, kind, tmp_path / kind, 6, every=5, batch=batch, workers=workers
            )

    for kind in ("torch", "hf"):
        run(kind, 64)  # saved at step 5
    assert list(run("torch", 32)) == [6]  # the fallback maps 5 x 64 samples onto batch 32
    with pytest.raises(UsageError, match="saved at 1 ranks x batch 64") as info:
        run("hf", 32)
    assert "\n" not in str(info.value)
    with pytest.raises(UsageError, match="num_workers=0, and") as info:
        run("hf", 64, workers=1)  # refused on resume, before any worker starts
    assert "\n" not in str(info.value)


def _saved(batches: int, world: int, batch: int) -> dict[str, int]:
    return {"epoch": 2, "batches": batches, "world": world, "batch_size": batch, "workers": 2}


def test_a_sharded_stream_saved_at_an_epoch_boundary_resumes_on_any_shape() -> None:
    """Position (epoch + 1, 0) replays nothing: any world, batch and worker count is exact."""
    with Parallel(strategy="single") as par:
        prepared = par.prepare(stream_job.loader("hf", 64, 0))
        prepared.check_resume(_saved(0, 3, 8), world=1)
        with pytest.raises(UsageError, match="saved at 3 ranks x batch 8"):
            prepared.check_resume(_saved(1, 3, 8), world=1)


def test_the_sharded_refusal_speaks_of_the_global_batch_under_split_batches() -> None:
    """With split_batches the user's batch_size is global: the line says which to pass."""
    with Parallel(strategy="single", split_batches=True) as par:
        prepared = par.prepare(stream_job.loader("hf", 64, 0))
        with pytest.raises(UsageError, match=r"2 ranks x global batch 16\b.*batch_size=16\b"):
            prepared.check_resume(_saved(5, 2, 8), world=1)


class _SlicesItself(IterableDataset):
    """The torch docs' idiom: each loader worker reads only its slice of the stream."""

    def __init__(self, n: int, lazy: bool) -> None:
        self.n, self.lazy = n, lazy

    def __iter__(self) -> Iterator[int]:
        return self._lazily() if self.lazy else self._slice()

    def _slice(self) -> Iterator[int]:
        info = get_worker_info()
        if info is None:
            return iter(range(self.n))
        per = -(-self.n // info.num_workers)
        return iter(range(info.id * per, min((info.id + 1) * per, self.n)))

    def _lazily(self) -> Iterator[int]:  # asks for the worker at the first next()
        yield from self._slice()


@pytest.mark.slow  # two forked loader workers per loader (no fresh interpreter)
def test_a_stream_that_slices_itself_per_worker_loses_no_sample() -> None:
    """The fallback's workers each read the whole stream: the stream must see one reader."""
    with Parallel(strategy="single") as par:
        for lazy in (False, True):
            data = _SlicesItself(64, lazy)
            prepared = par.prepare(DataLoader(data, batch_size=4, num_workers=2))
            assert [i for b in prepared for i in b.tolist()] == list(range(64)), lazy


def test_read_whole_shows_the_stream_no_loader_worker() -> None:
    """In a worker (as torch's worker loop sets it), every call into the stream sees none."""
    seen = []

    def stream() -> Iterator[int]:
        seen.append(get_worker_info())
        yield 1
        seen.append(get_worker_info())
        yield 2

    torch_worker._worker_info = torch_worker.WorkerInfo(id=1, num_workers=2, seed=0, dataset=None)
    try:
        assert list(read_whole(stream())) == [1, 2]
        assert seen == [None, None]
        assert get_worker_info() is not None  # shown again between the calls and after
    finally:
        torch_worker._worker_info = None


class _Pixels:
    """A stand-in for a PIL image: its repr carries its address, tobytes() its content."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def tobytes(self) -> bytes:
        return self.data


def _sample(label: int = 3, pixels: bytes = b"ab", row: int = 0) -> dict[str, object]:
    array = np.arange(6, dtype=np.uint8) + row
    plain = (label, 0.5, "cat", b"\x00", True, None)
    return {"plain": plain, "image": _Pixels(pixels), "row": array, "other": object()}


def test_the_order_check_fingerprints_content_not_memory_addresses() -> None:
    """Two processes build equal samples at different addresses (an HF image stream)."""
    assert _fingerprint(_sample()) == _fingerprint(_sample())
    for changed in (_sample(label=4), _sample(pixels=b"ac"), _sample(row=1)):
        assert _fingerprint(changed) != _fingerprint(_sample())


def test_the_step_agreement_group_has_the_job_s_timeout() -> None:
    """Not gloo's 30-minute default: a rank stuck there fails in the job's time, named."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:  # as rank 0 of 2 (the group is the one process there is): agreed steps
        stream = prepare_stream(
            stream_job.loader("hf", 8, 0), rank=0, world=2, train=True,
            split_batches=False, device=torch.device("cpu"), timeout_s=7.0,
        )  # fmt: skip
        assert stream._group is not None
        backend = stream._group._get_backend(torch.device("cpu"))
        assert backend.options._timeout == dt.timedelta(seconds=7)
        assert len(next(iter(stream))["id"]) == 8  # the agreement itself goes through
    finally:
        dist.destroy_process_group()


class _FreedWhere:
    """Garbage in a reference cycle: its ``__del__`` writes the pid of whoever frees it."""

    def __init__(self, marks: Path) -> None:
        self.marks, self.me = marks, self

    def __del__(self) -> None:
        _add_line(self.marks, os.getpid())


class _CollectsInWorker(Dataset[int]):
    """Each sample runs a full collection in the loader worker that reads it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        gc.collect()
        return i


class _StreamCollects(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        for i in range(8):
            gc.collect()
            yield i


def _add_line(path: Path, value: int) -> None:
    """Appends ``value`` to ``path`` (as a loader's ``worker_init_fn``: the worker's id)."""
    with open(path, "a") as fh:
        fh.write(f"{value}\n")


@pytest.mark.slow  # forked loader workers (no fresh interpreter)
def test_loader_workers_never_free_what_they_inherited_and_still_run_the_users_init(
    tmp_path: Path,
) -> None:
    """Garbage the parent had not collected when its loader forked (a process group
    in a cycle: freed in a worker, its destructor joins threads the worker lacks and
    aborts it) is freed by the parent alone, for a map-style loader and a stream;
    the user's ``worker_init_fn`` still runs in every worker."""
    marks, inits = tmp_path / "freed", tmp_path / "inits"
    init = functools.partial(_add_line, inits)
    with Parallel(strategy="single") as par:
        for data in (_CollectsInWorker(), _StreamCollects()):
            loader = par.prepare(DataLoader(data, batch_size=2, num_workers=2, worker_init_fn=init))
            gc.disable()  # no automatic collection frees it before the workers fork
            try:
                _FreedWhere(marks)
                got = sorted(i for b in loader for i in b.tolist())
            finally:
                gc.enable()
            gc.collect()
            assert got == list(range(8)), type(data)
            assert marks.read_text().split() == [str(os.getpid())], "freed in a worker too"
            marks.unlink()
    assert sorted(inits.read_text().split()) == ["0"] * 2 + ["1"] * 2


def test_the_worker_start_pickles_for_spawned_workers_and_runs_the_users_init(
    tmp_path: Path,
) -> None:
    """A ``spawn`` loader sends ``worker_init_fn`` pickled: ours must survive that."""
    inits = tmp_path / "inits"
    start = pickle.loads(pickle.dumps(worker_start(functools.partial(_add_line, inits))))
    frozen = gc.get_freeze_count()
    try:
        start(3)
        assert gc.get_freeze_count() > frozen
    finally:
        gc.unfreeze()
    assert inits.read_text() == "3\n"
    pickle.loads(pickle.dumps(worker_start(None)))(0)  # the default seeds numpy and random
    gc.unfreeze()
