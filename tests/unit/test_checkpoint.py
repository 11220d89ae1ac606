"""Checkpoints in one process: exact resume, atomicity, corruption, retention, safety.

The command line (inspect, export) runs in its own processes: tests/launch.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ckpt_job import build, train
from ckpt_sign import resign

from manygpu import Parallel
from manygpu.checkpoint import CheckpointError, TrainState
from manygpu.checkpoint.export import export_safetensors, inspect
from manygpu.checkpoint.preemption import PreemptionNotice, wants_requeue
from manygpu.checkpoint_io import formats, layout, writer
from manygpu.errors import UsageError
from manygpu.runtime import notice


def _run(
    directory: Path, total: int, every: int, **kw: object
) -> tuple[dict[int, float], torch.Tensor]:
    with Parallel(strategy="single") as par:
        return train(par, directory, total, every, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fmt, async_save", [("full", False), ("full", True), ("dcp", False), ("dcp", True)]
)
def test_resume_is_bit_identical(tmp_path: Path, fmt: str, async_save: bool) -> None:
    ref_losses, ref_params = _run(tmp_path / "ref", 30, every=0)
    _run(tmp_path / "ck", 17, every=5, fmt=fmt, async_save=async_save)  # "dies" after step 17
    losses, params = _run(tmp_path / "ck", 30, every=5, fmt=fmt)  # resumes at step 15, mid-epoch
    assert min(losses) == 16
    assert all(losses[s] == ref_losses[s] for s in losses)  # exactly the same losses
    assert torch.equal(params, ref_params)


def test_crash_inside_save_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Parallel(strategy="single") as par:
        _, _, _, _, ckpt = build(par, tmp_path, every=0)
        ckpt.save(TrainState(step=1))
        real = writer._torch_save  # what every checkpoint file is written with
        calls = {"n": 0}

        def dying_save(obj: object, f: writer.DurableFile) -> None:
            calls["n"] += 1
            if calls["n"] == 2:  # rng file written, then the model file "crashes"
                f.write(b"partial")
                raise OSError("disk died")
            real(obj, f)

        monkeypatch.setattr(writer, "_torch_save", dying_save)
        with pytest.raises(CheckpointError, match="disk died"):
            ckpt.save(TrainState(step=2))
        monkeypatch.setattr(writer, "_torch_save", real)
        assert [p.name for p in layout.committed(tmp_path)] == ["step-00000001"]
        assert not (tmp_path / "step-00000002.tmp").exists()  # removed at once (a full disk)
        assert ckpt.resume().step == 1
        (tmp_path / "step-00000002.tmp").mkdir()  # debris of a process that died mid-save
        ckpt.save(TrainState(step=3))
        assert not (tmp_path / "step-00000002.tmp").exists()  # ...is cleaned by the next save


def test_corrupt_latest_falls_back_and_is_named(tmp_path: Path) -> None:
    with Parallel(strategy="single") as par:
        _, _, _, _, ckpt = build(par, tmp_path, every=0)
        ckpt.save(TrainState(step=1))
        ckpt.save(TrainState(step=2))
        model_file = layout.step_dir(tmp_path, 2) / formats.MODEL
        model_file.write_bytes(model_file.read_bytes()[:-10])  # truncated
        with pytest.raises(CheckpointError, match=r"step-00000002 is corrupt: model.pt"):
            ckpt.resume(2)  # asked for by number: refused, and left where it is
        with pytest.warns(UserWarning, match=r"step-00000002 is corrupt: model.pt has.*aside"):
            assert ckpt.resume("latest").step == 1
        with pytest.raises(CheckpointError, match=r"moved aside to corrupt-step-00000002$"):
            ckpt.resume(2)
        flipped = layout.step_dir(tmp_path, 1) / formats.OPTIM
        data = bytearray(flipped.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size, one bit pattern changed
        flipped.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=r"optim\.pt fails its CRC-32 check in bytes 0-"):
            ckpt.resume(1)


def test_keeps_the_newest_k(tmp_path: Path) -> None:
    with Parallel(strategy="single") as par:
        _, _, _, _, ckpt = build(par, tmp_path, every=0)
        ckpt.keep = 2
        for step in range(1, 6):
            ckpt.save(TrainState(step=step))
        assert [p.name for p in layout.committed(tmp_path)] == ["step-00000004", "step-00000005"]


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("pwned",))


def test_loading_never_unpickles_arbitrary_objects(tmp_path: Path) -> None:
    with Parallel(strategy="single") as par:
        _, _, _, _, ckpt = build(par, tmp_path, every=0)
        final = ckpt.save(TrainState(step=1))
        torch.save({"x": _Evil()}, final / formats.EXTRAS)
        resign(final)  # so only weights_only can stop it
        with pytest.raises(CheckpointError, match="cannot be read"):
            ckpt.resume(1)


def test_inspect_and_export(tmp_path: Path) -> None:
    _run(tmp_path / "ck", 6, every=3)
    info = inspect(tmp_path / "ck")
    assert info["status"] == "ok" and info["step"] == 6 and info["format"] == "full"
    assert info["model_parameters"] == 8 * 16 + 16 + 16 * 4 + 4
    out = tmp_path / "w.safetensors"
    summary = export_safetensors(tmp_path / "ck", out)
    from safetensors.torch import load_file

    weights = load_file(str(out))
    saved = torch.load(layout.step_dir(tmp_path / "ck", 6) / formats.MODEL, weights_only=True)
    assert summary["tensors"] == 4 and all(torch.equal(weights[k], saved[k].cpu()) for k in saved)


def test_parallel_names_what_a_checkpoint_holds(tmp_path: Path) -> None:
    from torch import nn

    from manygpu.checkpoint import Checkpointer

    with Parallel(strategy="single", seed=7) as par:
        model = nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        prepared, prepared_opt = par.prepare(model, opt)
        parts = par.job_state.parts(prepared, prepared_opt)
        assert parts.format is formats.FULL and parts.model is par.unwrap(prepared)
        assert parts.optimizer is opt  # the optimizer holding the state, not our wrapper
        assert (parts.seed, parts.strategy, parts.precision) == (7, "single", "fp32")
        ckpt = Checkpointer(par, tmp_path, model=prepared, optimizer=prepared_opt, format="dcp")
        assert ckpt.parts.format is formats.DCP and ckpt.format == "dcp"
        assert parts.format is formats.FULL  # the job's answer is left as it was
        with pytest.raises(UsageError, match="unknown checkpoint format 'zip'; choose full or dcp"):
            Checkpointer(par, tmp_path, model=prepared, format="zip")


def test_saving_leaves_the_state_alone(tmp_path: Path) -> None:
    with Parallel(strategy="single") as par:
        _, _, _, loader, ckpt = build(par, tmp_path, every=0)
        loader.set_epoch(3)
        state = TrainState(step=2, epoch=0, extra={"best": 1.5})
        final = ckpt.save(state)
        assert state == TrainState(step=2, epoch=0, extra={"best": 1.5})
        meta = layout.read_meta(final)
        assert meta["epoch"] == 3 and meta["extra"] == {"best": 1.5}  # the loader's epoch
        assert ckpt.resume().epoch == 3


@pytest.fixture
def clean_notices() -> Iterator[None]:
    """Signals and their record are process-wide: restore both."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    notice.forget()
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        notice.forget()


@pytest.mark.usefixtures("clean_notices")
def test_a_sigterm_is_remembered_until_the_step_boundary() -> None:
    cpu = {"device": torch.device("cpu"), "world_size": 1, "timeout_s": 5.0}
    preemption = PreemptionNotice()
    preemption.listen()
    assert preemption.agreed(**cpu) is None
    os.kill(os.getpid(), signal.SIGTERM)  # handled: the process goes on
    assert preemption.agreed(**cpu) == signal.SIGTERM


@pytest.mark.usefixtures("clean_notices")
def test_slurms_warning_signal_is_a_notice_that_outranks_sigterm() -> None:
    """SIGUSR1 (``--signal=USR1@N``) is recorded, not fatal; with SIGTERM too, the
    warning is what the ranks agree on (it asks for a requeue)."""
    cpu = {"device": torch.device("cpu"), "world_size": 1, "timeout_s": 5.0}
    assert notice.record_warnings()
    os.kill(os.getpid(), signal.SIGUSR1)
    preemption = PreemptionNotice()
    preemption.listen()
    os.kill(os.getpid(), signal.SIGTERM)
    assert preemption.agreed(**cpu) == signal.SIGUSR1


@pytest.mark.usefixtures("clean_notices")
def test_a_first_ctrl_c_is_a_notice_and_a_second_one_stops_at_once() -> None:
    cpu = {"device": torch.device("cpu"), "world_size": 1, "timeout_s": 5.0}
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh process
    preemption = PreemptionNotice()
    preemption.listen()
    os.kill(os.getpid(), signal.SIGINT)  # handled: the loop goes on to its step boundary
    assert preemption.agreed(**cpu) == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.usefixtures("clean_notices")
def test_a_scripts_own_ctrl_c_handler_is_kept() -> None:
    def mine(signum: int, frame: object) -> None: ...

    signal.signal(signal.SIGINT, mine)
    notice.listen()
    assert signal.getsignal(signal.SIGINT) is mine


@pytest.mark.usefixtures("clean_notices")
def test_a_users_own_sigusr1_handler_is_kept() -> None:
    def mine(signum: int, frame: object) -> None: ...

    signal.signal(signal.SIGUSR1, mine)
    assert not notice.record_warnings()
    notice.listen()
    assert signal.getsignal(signal.SIGUSR1) is mine


@pytest.mark.parametrize(
    ("requeue", "signum", "env", "expected"),
    [
        (None, signal.SIGUSR1, {"SLURM_JOB_ID": "7"}, True),  # the time limit is near
        (None, signal.SIGTERM, {"SLURM_JOB_ID": "7"}, False),  # scancel: stop
        (None, signal.SIGUSR1, {}, False),  # not under Slurm: nothing to requeue
        (True, signal.SIGTERM, {"SLURM_JOB_ID": "7"}, True),  # asked
        (False, signal.SIGUSR1, {"SLURM_JOB_ID": "7"}, False),  # refused
    ],
)
def test_when_a_notice_requeues_the_slurm_job(
    requeue: bool | None, signum: int, env: dict[str, str], expected: bool
) -> None:
    assert wants_requeue(requeue, signum, env) is expected
