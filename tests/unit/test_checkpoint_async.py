"""Checkpoints that do not stall training: async snapshots, hashing while writing, fast resume.

- An asynchronous save whose background write is held mid-file (a writer
  that waits on an Event, no sleeps) while the loop takes the next optimizer
  step still stores, bitwise, the state of the step it was asked for: for the
  ``full`` format (our thread) and for ``dcp`` (``dcp.async_save``).
- kill -9 during that background write leaves the previous checkpoint intact
  (a real process, marked slow), in both formats.
- The snapshot buffers are allocated once and reused (ours for ``full``,
  torch's stager for ``dcp``); no file is read back to
  checksum it (a save with file hashing disabled still commits); streamed
  checksums equal the file's in any chunking and name the damaged segment;
  schema 1 checkpoints (plain SHA-256) still load and verify.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_job import build
from torch import nn

from manygpu import Parallel
from manygpu.checkpoint import CheckpointError, TrainState
from manygpu.checkpoint_io import formats, integrity, layout, writer
from manygpu.checkpoint_io.staging import Staging, pin_wanted

HELPERS = Path(__file__).resolve().parents[1] / "helpers"


def _step(par: Parallel, model: Any, opt: Any, loader: Any) -> None:
    x, y = next(iter(loader))
    par.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_clone(v) for v in tree)
    return tree


def _same(a: Any, b: Any) -> bool:
    """Bitwise equality of two state trees."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


HELD: dict[str, Callable[[Path], bool]] = {
    "full": lambda path: path.name == formats.MODEL,  # written by our thread
    "dcp": lambda path: path.suffix == ".distcp",  # a shard, written by DCP's thread
}
"""Per format, the file whose background write the tests hold mid-way."""


def hold_writes(
    monkeypatch: pytest.MonkeyPatch, fmt: str
) -> tuple[threading.Event, threading.Event]:
    """The first background write into ``HELD[fmt]``'s file stops after one buffer until ``go``."""
    started, go = threading.Event(), threading.Event()
    real = writer.DurableFile.write

    def write(self: writer.DurableFile, data: Any) -> int:
        n = real(self, data)
        if HELD[fmt](self.path) and not started.is_set():
            started.set()
            assert go.wait(timeout=60), "the test never released the writer"
        return n

    monkeypatch.setattr(writer.DurableFile, "write", write)
    return started, go


@pytest.mark.parametrize("fmt", ["full", "dcp"])
def test_async_save_stores_the_step_it_was_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    started, go = hold_writes(monkeypatch, fmt)
    with Parallel(strategy="single") as par:
        model, opt, _, loader, ckpt = build(par, tmp_path, every=0, fmt=fmt, async_save=True)
        _step(par, model, opt, loader)  # Adam state exists
        module = par.unwrap(model)
        want_model, want_optim = _clone(module.state_dict()), _clone(opt.state_dict())
        final = ckpt.save(TrainState(step=1))
        try:
            assert started.wait(timeout=60)  # the background thread is inside a file
            assert not final.exists()  # ...so nothing is committed yet
            _step(par, model, opt, loader)  # the next step changes what is being saved
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(1.0)
        finally:
            go.set()
        ckpt.wait()
        assert layout.verify(final).step == 1
        assert not _same(_clone(module.state_dict()), want_model)  # the race was real
        if fmt == "full":  # the files themselves
            saved_model = torch.load(final / formats.MODEL, weights_only=True)
            saved_optim = torch.load(final / formats.OPTIM, weights_only=True)
            assert _same(saved_model, want_model) and _same(saved_optim, want_optim)
        assert ckpt.resume(1).step == 1  # what a resume puts back
        assert _same(_clone(module.state_dict()), want_model)
        assert _same(_clone(opt.state_dict()), want_optim)


def test_snapshot_buffers_are_allocated_once_and_reused(tmp_path: Path) -> None:
    with Parallel(strategy="single") as par:
        model, opt, _, loader, ckpt = build(par, tmp_path, every=0, async_save=True)
        _step(par, model, opt, loader)
        staging = ckpt._staging
        assert staging is not None and staging.pin is False  # no CUDA: never pinned
        ckpt.save(TrainState(step=1))
        ckpt.wait()
        allocated = staging.allocated
        assert allocated > 0
        _step(par, model, opt, loader)
        ckpt.save(TrainState(step=2))
        ckpt.wait()
        assert staging.allocated == allocated  # the second save reused every buffer
        ckpt.resume(2)
        assert torch.equal(
            torch.load(layout.step_dir(tmp_path, 2) / formats.MODEL)["0.weight"],
            par.unwrap(model).state_dict()["0.weight"],
        )


@pytest.mark.parametrize("fmt", ["full", "dcp"])
@pytest.mark.parametrize("async_save", [True, False])
def test_a_failed_write_is_one_line_and_leaves_the_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, async_save: bool
) -> None:
    """A disk filling up mid-write: save() or wait() names it, nothing half-written stays."""
    with Parallel(strategy="single") as par:
        model, opt, _, loader, ckpt = build(par, tmp_path, every=0, fmt=fmt, async_save=async_save)
        _step(par, model, opt, loader)
        ckpt.save(TrainState(step=1))
        ckpt.wait()
        real = writer.DurableFile.write

        def full_disk(self: writer.DurableFile, data: Any) -> int:
            if HELD[fmt](self.path):
                raise OSError(28, "No space left on device")
            return real(self, data)

        monkeypatch.setattr(writer.DurableFile, "write", full_disk)
        _step(par, model, opt, loader)
        with pytest.raises(CheckpointError, match="no space left on the device") as info:
            ckpt.save(TrainState(step=2))  # async: returns; the write fails in the background
            ckpt.wait()
        assert "\n" not in str(info.value) and "CheckpointException" not in str(info.value)
        monkeypatch.setattr(writer.DurableFile, "write", real)
        assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]
        layout.verify(layout.step_dir(tmp_path, 1))
        ckpt.wait()  # the error was reported once
        ckpt.save(TrainState(step=3))  # and the next save works
        ckpt.close()
        assert [p.name for p in layout.committed(tmp_path)] == ["step-00000001", "step-00000003"]


def test_dcp_staging_reuses_torchs_buffers_across_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's stager, held by our Staging, copies into the same CPU memory at every save."""
    staging = Staging(pin=False)
    weight = torch.randn(4, 3)
    tree = {"w": weight, "optim": {"state": {0: {"exp_avg": torch.randn(5)}}, "lr": 0.1}}
    stager = staging.dcp_stager()
    first = stager.stage(tree)
    weight.add_(1.0)
    assert not torch.equal(first["w"], weight)  # a copy, not a view
    assert staging.dcp_stager() is stager
    second = stager.stage(tree)
    assert second["w"].data_ptr() == first["w"].data_ptr() and torch.equal(second["w"], weight)
    exp_avg = second["optim"]["state"][0]["exp_avg"]
    assert exp_avg.data_ptr() == first["optim"]["state"][0]["exp_avg"].data_ptr()
    staging.close()
    # Through the checkpointer: the second async dcp save stages into the first one's memory.
    with Parallel(strategy="single") as par:
        model, opt, _, loader, ckpt = build(par, tmp_path, every=0, fmt="dcp", async_save=True)
        _step(par, model, opt, loader)
        seen: list[int] = []
        real = type(ckpt._staging.dcp_stager()).stage

        def stage(self: Any, state: Any, **kw: Any) -> Any:
            staged = real(self, state, **kw)
            seen.append(staged["model"]["0.weight"].data_ptr())
            return staged

        monkeypatch.setattr(type(ckpt._staging.dcp_stager()), "stage", stage)
        for step in (1, 2):
            _step(par, model, opt, loader)
            ckpt.save(TrainState(step=step))
        ckpt.close()
        assert len(seen) == 2 and seen[0] == seen[1]
        assert [p.name for p in layout.committed(tmp_path)] == ["step-00000001", "step-00000002"]


def test_staging_copies_into_the_same_buffers_and_keeps_ties() -> None:
    weight = torch.randn(4, 3)
    tree = {"a": weight, "tied": weight.detach(), "n": [torch.tensor(2.0), 7], "s": "x"}
    staging = Staging(pin=pin_wanted(cuda_available=False))
    first = staging.stage({"f": tree})["f"]
    assert first["a"] is first["tied"]  # one storage saved once
    assert first["n"][1] == 7 and first["s"] == "x" and first["n"] is not tree["n"]
    ptr = first["a"].data_ptr()
    weight.add_(1.0)
    assert not torch.equal(first["a"], weight)  # a copy, not a view
    second = staging.stage({"f": tree})["f"]
    assert second["a"].data_ptr() == ptr and torch.equal(second["a"], weight)
    assert staging.allocated == 2
    assert pin_wanted(cuda_available=True) and not pin_wanted(cuda_available=False)


@pytest.mark.parametrize("fmt", ["full", "dcp"])
def test_a_save_never_reads_its_files_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """Every file's checksum comes from its writer: hashing a file after the fact fails here."""

    def reread(*args: Any, **kwargs: Any) -> str:
        raise AssertionError(f"a file was read back to hash it: {args[0]}")

    with Parallel(strategy="single") as par:
        model, opt, _, loader, ckpt = build(par, tmp_path, every=0, fmt=fmt)
        _step(par, model, opt, loader)
        real = integrity.file_digest
        monkeypatch.setattr(integrity, "file_digest", reread)
        final = ckpt.save(TrainState(step=1))
        monkeypatch.setattr(integrity, "file_digest", real)
        meta = layout.verify(final).meta  # the streamed digests match the files
        assert meta["schema"] == 2 and meta["checksum"] == integrity.CHECKSUM
        assert len(meta["files"]) >= 3
        assert ckpt.resume(1).step == 1


@pytest.mark.parametrize("chunks", [[1, 99, 1000, 5], [2500, 1, 1], [999, 1001, 1000], [3333]])
def test_streamed_digest_equals_the_file_digest_in_any_chunking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunks: list[int]
) -> None:
    monkeypatch.setattr(integrity, "SEGMENT", 1000)  # many segment boundaries
    monkeypatch.setattr(integrity, "_INLINE", 100)  # both inline and pooled pieces
    data = os.urandom(sum(chunks))
    path = tmp_path / "f.bin"
    with integrity.hashing_pool() as pool:
        with writer.DurableFile(path, pool) as fh:
            pos = 0
            for n in chunks:
                fh.write(memoryview(data)[pos : pos + n])
                pos += n
        assert path.read_bytes() == data
        assert fh.entry() == {"bytes": len(data), "crc32": integrity.file_digest(path, pool)}
        segments = [data[i : i + 1000] for i in range(0, len(data), 1000)]
        want = "".join(f"{zlib.crc32(s):08x}" for s in segments)
        assert fh.entry()["crc32"] == want
        damaged = bytearray(data)
        damaged[-1] ^= 1
        path.write_bytes(bytes(damaged))
        start = (len(data) - 1) // 1000 * 1000  # the last segment's
        assert integrity.first_damage(want, integrity.file_digest(path, pool)) == (
            start,
            start + 1000,
        )


def test_schema_1_checkpoints_still_load_and_verify(tmp_path: Path) -> None:
    with Parallel(strategy="single") as par:
        _, _, _, _, ckpt = build(par, tmp_path, every=0)
        final = ckpt.save(TrainState(step=4))
        meta = layout.read_meta(final)
        meta.pop("checksum")
        meta["schema"] = 1
        for name, entry in meta["files"].items():  # what schema 1 listed: plain SHA-256
            del entry["crc32"]
            entry["sha256"] = hashlib.sha256((final / name).read_bytes()).hexdigest()
        (final / layout.META).write_text(json.dumps(meta))
        assert ckpt.resume().step == 4
        optim = final / formats.OPTIM
        data = bytearray(optim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        optim.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=r"optim\.pt fails its SHA-256 check"):
            ckpt.resume(4)
        meta["schema"], meta["checksum"] = 2, "sha256"  # schema 2 names its checksum
        (final / layout.META).write_text(json.dumps(meta))
        with pytest.raises(CheckpointError, match="checksum 'sha256'"):
            ckpt.resume(4)


def test_resume_leaves_no_state_mapped_to_the_checkpoint_file(tmp_path: Path) -> None:
    """A resumed CPU optimizer owns its state (else a pruned file's disk space stays held)."""
    with Parallel(strategy="single") as par:
        model, opt, _, loader, ckpt = build(par, tmp_path, every=0)
        _step(par, model, opt, loader)
        want = _clone(opt.state_dict())
        ckpt.save(TrainState(step=1))
        _step(par, model, opt, loader)
        held = {
            (id(p), k): v.data_ptr()
            for p, state in opt.state.items()
            for k, v in state.items()
            if isinstance(v, torch.Tensor)
        }
        ckpt.resume(1)
        assert _same(opt.state_dict(), want)
        for param, state in opt.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    assert value.untyped_storage().filename is None
                    # A live optimizer's state tensors receive the values in place.
                    assert value.data_ptr() == held[(id(param), key)]
        fresh = torch.optim.Adam(par.unwrap(model).parameters(), lr=1e-2)  # no state yet
        mapped = formats.load_file(layout.step_dir(tmp_path, 1) / formats.OPTIM, mmap=True)
        formats._load_optimizer(fresh, mapped)
        assert _same(fresh.state_dict(), want)
        for state in fresh.state.values():  # cloned out of the mapping
            assert all(v.untyped_storage().filename is None for v in state.values())


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["full", "dcp"])
def test_kill_9_during_the_background_write_keeps_the_previous_checkpoint(
    tmp_path: Path, fmt: str
) -> None:
    ck, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HELPERS), *sys.path]))
    job = subprocess.Popen(
        [sys.executable, str(HELPERS / "ckpt_async_job.py"), str(ck), str(out), fmt],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "writing").exists():  # the marker: step 6's write is in progress
            assert job.poll() is None, job.communicate()[1]
            assert time.monotonic() < deadline, "the job never reached the second save"
            time.sleep(0.05)
        partial = Path((out / "writing").read_text())
        assert layout.tmp_dir(ck, 6) in partial.parents and partial.stat().st_size > 0
        os.kill(job.pid, signal.SIGKILL)
    finally:
        if job.poll() is None:
            job.kill()
        job.communicate(timeout=30)
    assert job.returncode == -signal.SIGKILL
    assert [p.name for p in layout.committed(ck)] == ["step-00000003"]
    layout.verify(layout.step_dir(ck, 3))  # every size and checksum intact
    with Parallel(strategy="single") as par:
        model, _, _, _, ckpt = build(par, ck, every=0, fmt=fmt, async_save=True)
        assert ckpt.resume().step == 3
        want = torch.load(out / "params-3.pt")
        got = list(par.unwrap(model).parameters())
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        ckpt.save(TrainState(step=7))
        ckpt.wait()
        assert not layout.tmp_dir(ck, 6).exists()  # the dead save's debris is cleaned


def test_async_dcp_on_a_torch_without_its_stager_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.checkpoint import staging

    from manygpu.errors import UsageError

    monkeypatch.delattr(staging, "DefaultStager")
    with Parallel(strategy="single") as par, pytest.raises(UsageError) as info:
        build(par, tmp_path, every=0, fmt="dcp", async_save=True)
    assert "format='full'" in str(info.value) and "\n" not in str(info.value)
    with Parallel(strategy="single") as par:  # a blocking dcp save does not need it
        build(par, tmp_path, every=0, fmt="dcp")
