"""Checkpoints to a real S3-protocol server (moto's, on 127.0.0.1) from 2 gloo ranks.

One start of 2 rank processes serves every case, to keep the suite short: for
``full`` and ``dcp``, blocking and asynchronous, a run that saves every 5 steps
to ``s3://`` and stops after step 12 resumes at step 10 and ends with the same
losses and parameters, bitwise (fp32 on the CPU), as a run that never stopped.
Each rank writes its own objects; the main rank's ``meta.json`` lists them
all. The ``dcp`` checkpoint saved by 2 ranks then loads in 1 process
(another world size), parameters and optimizer state exact.

A process killed (``kill -9``) while an asynchronous save uploads leaves that
step uncommitted: the resume starts from the step before, and the run ends
bitwise as one that was never killed. A SIGTERM during an upload lets it
finish, saves the step the loop is at, and exits 0: every step it lists is
committed and verifies, none is half there.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_job import build, train
from dist_harness import JOB_VARIABLES, _context, preload, run_ranks
from s3_server import BUCKET, s3_server

from manygpu import Parallel
from manygpu.checkpoint_io import remote, remote_layout

pytest.importorskip("s3fs")
pytest.importorskip("moto")
# The S3 client stack (s3fs, aiobotocore: ~0.5 CPU-s) once in the rank server, not per rank.
preload("ckpt_job", "s3fs", "manygpu.checkpoint_io.remote")

CASES = [("full", False), ("full", True), ("dcp", False), ("dcp", True)]


def _train(directory: str, total: int, every: int, fmt: str, async_save: bool) -> Any:
    with Parallel(strategy="ddp", timeout_s=60) as par:
        return train(par, directory, total, every, fmt=fmt, async_save=async_save)


def _every_case(reference: str, urls: list[str]) -> dict[str, dict[str, bool]]:
    """On each rank: a reference run, then per case a run that stops and one that resumes."""
    ref_losses, ref_params = _train(reference, 20, 0, "full", False)
    out = {}
    for url, (fmt, async_save) in zip(urls, CASES, strict=True):
        _train(url, 12, 5, fmt, async_save)  # "dies" after step 12
        losses, params = _train(url, 20, 5, fmt, False)  # resumes at step 10
        out[f"{fmt}, async={async_save}"] = {
            "resumed at 10": min(losses) == 11,
            "same losses": all(losses[s] == ref_losses[s] for s in losses),
            "same params": torch.equal(params, ref_params),
        }
    return out | {"params": {"final": ref_params}}  # type: ignore[dict-item]


def _load_alone(url: str) -> tuple[int, torch.Tensor, torch.Tensor]:
    with Parallel(strategy="ddp") as par:  # one process: a 1-rank group
        model, opt, *_, ckpt = build(par, url, 0, "dcp")
        state = ckpt.resume()
        inner = opt.optimizer
        first = inner.state[inner.param_groups[0]["params"][0]]["exp_avg"].clone()
        params = torch.cat([p.detach().reshape(-1) for p in par.unwrap(model).parameters()])
        ckpt.close()
        return state.step, params, first


@pytest.mark.slow
def test_save_and_resume_at_two_ranks_through_s3_bitwise(tmp_path: Path) -> None:
    with s3_server():
        urls = [f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}-{f}-{a}" for f, a in CASES]
        results = run_ranks(_every_case, 2, str(tmp_path / "ref"), urls, timeout=170)
        for rank, checks in enumerate(results):
            final = checks.pop("params")["final"]
            for case, found in checks.items():
                assert all(found.values()), f"rank {rank}, {case}: {found}"
        for url, (fmt, _) in zip(urls, CASES, strict=True):
            (*_, last) = remote_layout.committed(remote.connect(url))
            meta = remote_layout.verify(last).meta
            assert last.name == "step-00000020"
            assert {"rng-rank0.pt", "rng-rank1.pt"} <= set(meta["files"])  # each rank's own
            if fmt == "dcp":  # both ranks' shards, listed by the main rank's meta.json
                assert sum(n.endswith(".distcp") for n in meta["files"]) == 2
        step, params, exp_avg = _load_alone(urls[3])  # dcp saved by 2 ranks, on 1
        assert step == 20
        assert torch.equal(params, final)  # exact
        assert exp_avg.shape == (16, 8) and exp_avg.abs().sum() > 0


def _dies_mid_upload(url: str, flag: str, hold_s: float = 600.0) -> None:
    """Trains with async saves every 5 steps; step 10's optim.pt upload is held ``hold_s``
    (the test signals this process meanwhile)."""
    real = remote.ObjectFile.write

    def write(self: remote.ObjectFile, data: Any) -> int:
        n = real(self, data)
        held = self.target.parent.name == "step-00000010" and self.target.name == "optim.pt"
        if held and not Path(flag).exists():  # once: a retried write goes through
            Path(flag).write_text("uploading")
            time.sleep(hold_s)
        return n

    remote.ObjectFile.write = write  # type: ignore[method-assign]  # a process of its own
    with Parallel(strategy="single") as par:
        train(par, url, 20, 5, async_save=True)


def _dies_in(env: dict[str, str], url: str, flag: str, hold_s: float) -> None:
    """:func:`_dies_mid_upload` in this test's environment (the server's own is older)."""
    os.environ.clear()
    os.environ.update(env)
    _dies_mid_upload(url, flag, hold_s)


def _start_and_wait(url: str, flag: Path, hold_s: float) -> Any:
    """The job in a process of its own, once step 10's upload is under way.

    Forked from the rank server, which has torch loaded: a spawned process would
    import it again (~2.5 CPU-s). The process is still new, and only this job's.
    """
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}
    proc = _context().Process(target=_dies_in, args=(env, url, str(flag), hold_s), daemon=True)
    proc.start()
    deadline = time.monotonic() + 120
    while not flag.exists() and proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert flag.exists(), "the job never reached step 10's upload"
    return proc


@pytest.mark.slow
def test_sigterm_during_an_upload_finishes_it_and_commits_the_next_step(tmp_path: Path) -> None:
    with s3_server():
        url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}-term"
        proc = _start_and_wait(url, tmp_path / "flag", hold_s=2.0)
        os.kill(proc.pid, signal.SIGTERM)  # type: ignore[arg-type]
        proc.join(timeout=60)
        assert proc.exitcode == 0
        root = remote.connect(url)
        steps = remote_layout.committed(root)
        names = [u.name for u in steps]
        # The held upload finished and committed; the notice saved the step the loop was
        # at (past 10: the loop ran on while step 10 uploaded) and the job exited 0.
        assert "step-00000010" in names and names[-1] > "step-00000010", names
        for step in steps:
            remote_layout.verify(step)  # every object there, every checksum right
        assert all(r["state"] == "complete" for r in remote_layout.rows(root))  # none half


@pytest.mark.slow
def test_kill_9_during_an_upload_leaves_the_last_committed_step(tmp_path: Path) -> None:
    with Parallel(strategy="single") as par:
        ref_losses, ref_params = train(par, tmp_path / "ref", 20, 0)
    with s3_server():
        url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}-killed"
        proc = _start_and_wait(url, tmp_path / "flag", hold_s=600.0)
        os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        proc.join(timeout=30)
        root = remote.connect(url)
        assert [u.name for u in remote_layout.committed(root)] == ["step-00000005"]
        half = remote_layout.objects(root / "step-00000010")
        assert half and "meta.json" not in half  # objects landed, no commit
        with Parallel(strategy="single") as par:
            losses, params = train(par, url, 20, 5)  # resumes at step 5
    assert min(losses) == 6
    assert all(losses[s] == ref_losses[s] for s in losses)
    assert torch.equal(params, ref_params)
