"""Corrupt checkpoints are moved aside by resume, so a new run's saves are never pruned.

Pruning verifies sizes only (hashing every checkpoint at every save would cost
too much), so a bit-flipped checkpoint counts as good there, and a corrupt one
with a higher step number would outrank every checkpoint a fresh run saves.
Resume has hashed them: it renames each corrupt one to ``corrupt-step-N``,
which is never counted, loaded or pruned.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from ckpt_job import build, train

from manygpu import Parallel
from manygpu.checkpoint import CheckpointError, TrainState
from manygpu.checkpoint_io import formats, layout


def flip(step: Path) -> None:
    """One byte of model.pt changed, its size kept: only a checksum sees it."""
    model = step / formats.MODEL
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))


def names(root: Path, prefix: str = layout.PREFIX) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(prefix))


def test_a_fresh_start_over_corrupt_checkpoints_keeps_what_it_saves(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with Parallel(strategy="single") as par:
        train(par, root, 6, every=1)  # keep=3: steps 4, 5 and 6 remain
    for path in layout.committed(root):
        flip(path)
    with Parallel(strategy="single") as par:
        ckpt = build(par, root, every=0)[-1]
        with pytest.warns(UserWarning), pytest.raises(CheckpointError) as info:
            ckpt.resume()  # without fresh_ok: refused, in one line, nothing moved
        assert "every checkpoint" in str(info.value) and "\n" not in str(info.value)
        assert names(root) == ["step-00000004", "step-00000005", "step-00000006"]
    with Parallel(strategy="single") as par, pytest.warns(UserWarning) as seen:
        losses, _ = train(par, root, 3, every=1, fresh_ok=True)  # keep=3
    assert sorted(losses) == [1, 2, 3]
    assert names(root) == ["step-00000001", "step-00000002", "step-00000003"]
    moved = " ".join(str(w.message) for w in seen)
    for step in (4, 5, 6):
        assert f"corrupt-step-0000000{step}" in moved, moved
    assert names(root, "corrupt-") == [f"corrupt-step-0000000{s}" for s in (4, 5, 6)]
    assert all((root / n / formats.MODEL).is_file() for n in names(root, "corrupt-"))
    with Parallel(strategy="single") as par, warnings.catch_warnings():
        warnings.simplefilter("error")  # the moved ones are no longer looked at
        assert build(par, root, every=0)[-1].resume().step == 3


def test_moved_aside_checkpoints_still_stop_a_silent_fresh_start(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with Parallel(strategy="single") as par:
        ckpt = build(par, root, every=0)[-1]
        for step in (1, 2):
            flip(ckpt.save(TrainState(step=step)))
        with pytest.warns(UserWarning, match="corrupt-step-00000002"):
            assert ckpt.resume(fresh_ok=True).step == 0
        assert layout.committed(root) == []
        # The job died before its first save: a plain resume must not start over silently.
        with pytest.raises(CheckpointError, match="corrupt-step-00000001") as info:
            ckpt.resume()
        assert "\n" not in str(info.value)
        assert ckpt.resume(fresh_ok=True).step == 0
        assert names(root, "corrupt-") == ["corrupt-step-00000001", "corrupt-step-00000002"]


def test_corrupt_newer_checkpoints_are_moved_aside_when_an_older_one_loads(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ck"
    with Parallel(strategy="single") as par:
        ckpt = build(par, root, every=0)[-1]
        for step in (1, 2, 3):
            ckpt.save(TrainState(step=step))
        flip(layout.step_dir(root, 3))
        with pytest.warns(UserWarning, match=r"step-00000003 is corrupt.*corrupt-step-00000003"):
            assert ckpt.resume().step == 2
        assert names(root) == ["step-00000001", "step-00000002"]
        # The same step corrupt again: moved aside beside the first, nothing overwritten.
        flip(ckpt.save(TrainState(step=3)))
        with pytest.warns(UserWarning, match=r"corrupt-step-00000003\.1"):
            assert ckpt.resume().step == 2
        assert names(root, "corrupt-") == ["corrupt-step-00000003", "corrupt-step-00000003.1"]


def test_an_asked_for_corrupt_checkpoint_is_refused_and_left_in_place(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with Parallel(strategy="single") as par:
        ckpt = build(par, root, every=0)[-1]
        flip(ckpt.save(TrainState(step=1)))
        with pytest.raises(CheckpointError, match="step-00000001 is corrupt"):
            ckpt.resume(1)
        assert names(root) == ["step-00000001"] and names(root, "corrupt-") == []
