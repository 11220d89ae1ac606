"""Two gloo ranks resume over corrupt checkpoints: the main rank moves them aside, once.

The main rank verifies, renames the corrupt ones and broadcasts its decision;
every rank starts from it, and the fresh run's saves are kept.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from ckpt_job import build, train
from dist_harness import run_ranks

from manygpu import Parallel
from manygpu.checkpoint import CheckpointError
from manygpu.checkpoint_io import formats, layout


def flip(step: Path) -> None:
    """One byte of model.pt changed, its size kept: only a checksum sees it."""
    model = step / formats.MODEL
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))


def names(root: Path, prefix: str = layout.PREFIX) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(prefix))


def _train(directory: str, total: int, fresh_ok: bool) -> dict[str, Any]:
    par = Parallel(strategy="ddp")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            losses, _ = train(par, directory, total, every=1, fresh_ok=fresh_ok)
        return {"steps": sorted(losses), "warned": [str(w.message) for w in seen]}
    finally:
        par.close()


def _plain_resume(directory: str) -> str:
    par = Parallel(strategy="ddp")
    try:
        ckpt = build(par, directory, every=0)[-1]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                return f"step {ckpt.resume().step}"
            except CheckpointError as exc:
                return str(exc)
    finally:
        par.close()


def test_two_ranks_move_corrupt_checkpoints_aside_and_keep_new_saves(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    run_ranks(_train, 2, str(root), 6, False, timeout=120)  # steps 4, 5, 6 kept
    for step in layout.committed(root):
        flip(step)
    refused = run_ranks(_plain_resume, 2, str(root))
    assert all(r.startswith("every checkpoint") for r in refused), refused
    fresh = run_ranks(_train, 2, str(root), 3, True, timeout=120)
    assert [r["steps"] for r in fresh] == [[1, 2, 3], [1, 2, 3]]
    assert names(root) == ["step-00000001", "step-00000002", "step-00000003"]
    assert any("corrupt-step-00000006" in w for w in fresh[0]["warned"]), fresh[0]
    assert names(root, "corrupt-") == [f"corrupt-step-0000000{s}" for s in (4, 5, 6)]
    assert run_ranks(_plain_resume, 2, str(root)) == ["step 3", "step 3"]
