"""Iterable datasets in one process: the split's arithmetic, refusals, exact resume.

Loader workers and ranks are real processes: tests/launch/test_streams_launch.py.
Here every reader of the fallback split is simulated by calling :func:`blocks`
with its (rank, worker).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import stream_job
from torch.utils.data import DataLoader, IterableDataset

from manygpu import Parallel
from manygpu.core.streams import Reader, blocks
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
def test_fallback_resume_continues_at_the_same_sample(saved: int, now: int) -> None:
    done = 17 * saved * BATCH  # what the checkpoint's position says was read
    resumed = _steps(now, skip=done)
    step = now * BATCH
    for k in range(len(resumed[0])):
        glued = [i for r in resumed for i in r[k]]
        assert glued == list(range(done + k * step, done + (k + 1) * step))


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


def test_a_sharded_stream_resumed_on_another_batch_size_is_refused(tmp_path: Path) -> None:
    """Shards replay the batches taken: another batch size would read other samples."""

    def run(kind: str, batch: int) -> dict[int, list[int]]:
        with Parallel(strategy="single") as par:
            return stream_job.train(par, kind, tmp_path / kind, 6, every=5, batch=batch, workers=0)

    for kind in ("torch", "hf"):
        run(kind, 64)  # saved at step 5
    assert list(run("torch", 32)) == [6]  # the fallback maps 5 x 64 samples onto batch 32
    with pytest.raises(UsageError, match="saved at 1 ranks x batch 64") as info:
        run("hf", 32)
    assert "\n" not in str(info.value)
