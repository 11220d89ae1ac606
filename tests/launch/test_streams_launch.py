"""Iterable datasets, two loader workers per rank: one job per world size.

At 2 ranks the job runs under ``manygpu launch``, which restarts it after a
kill; at 3 ranks, where nothing is killed, the same script runs on ranks the
test harness forks (no launcher, and no torch import per rank: ~20 CPU-s less).

Each job, on 1,003 numbered samples, for the fallback split (a plain
``IterableDataset``) and Hugging Face shards: kill -9 of a rank mid-epoch (at 2
ranks: one kill while both streams train, step for step, the torch one in its
first epoch and the hf one in its second), then the resumed run reads what an
uninterrupted one reads; every sample read exactly once per epoch but the documented tail,
the same number of steps on every rank, each epoch in its own order; training
on the fallback split equals one process reading the stream in global batches;
a stream whose order differs between ranks is refused.
"""

from __future__ import annotations

import json
import multiprocessing
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import stream_job
import torch
from dist_harness import run_ranks
from jobs import subprocess_env
from reference import flat_params, make_model
from torch import nn
from torch.utils.data import DataLoader

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "stream_launch.py"
BATCH, WORKERS, TOTAL = 8, 2, 70  # TOTAL: into the second epoch of either stream


def _launch(tmp: Path, world: int, kill_torch: int, kill_hf: int) -> list[dict[str, Any]]:
    out = tmp / "out"
    out.mkdir()
    restarts = int(kill_torch > 0)  # one kill stops both streams
    cmd = [sys.executable, "-m", "manygpu", "launch", "--nproc-per-node", str(world)]
    # --timeout: a job that stops moving ends in a verdict naming the rank and line, well
    # before this test's own limit (under load a healthy run took from 45 s to over 180 s).
    cmd += ["--max-restarts", str(restarts), "--timeout", "90"]
    cmd += [str(SCRIPT), str(tmp / "ck"), str(out), str(TOTAL), str(kill_torch), str(kill_hf)]
    env = subprocess_env() | {"OMP_NUM_THREADS": "1"}
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=540)
    except subprocess.TimeoutExpired as exc:
        said = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        pytest.fail(f"the job ran past 540 s: {(said or '')[-4000:]}")
    assert run.returncode == 0, run.stderr[-4000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def _run_script(ckpt: str, out: str) -> None:
    """The job's script on a rank forked by the test harness (no launcher, no restart)."""
    # As a launched rank: the loaders' workers forked (the harness's ranks come from
    # its fork server, and would ask it), and allowed (the harness's ranks are daemonic,
    # and multiprocessing lets no daemonic process start children).
    multiprocessing.set_start_method("fork", force=True)
    multiprocessing.current_process().daemon = False
    sys.argv = [str(SCRIPT), ckpt, out, str(TOTAL), "0", "0"]
    runpy.run_path(str(SCRIPT), run_name="__main__")


def _forked(tmp: Path, world: int) -> list[dict[str, Any]]:
    out = tmp / "out"
    out.mkdir()
    run_ranks(_run_script, world, str(tmp / "ck"), str(out), timeout=300)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def _one_process_reference(world: int) -> torch.Tensor:
    """Plain torch in one process: the stream in global batches, the last partial one dropped."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stream = stream_job.Numbers(shuffle=False)
    for _, x, y in DataLoader(stream, batch_size=BATCH * world, drop_last=True):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return flat_params(model)


def _check_epochs(results: list[dict[str, Any]], kind: str, world: int) -> None:
    n, global_batch = stream_job.SAMPLES, BATCH * world
    firsts = []
    for epoch in range(2):
        per_rank = [r[f"epochs-{kind}"][epoch] for r in results]
        steps = {len(p) for p in per_rank}
        assert len(steps) == 1, (kind, epoch, steps)  # every rank the same number of steps
        ids = [i for p in per_rank for batch in p for i in batch]
        assert len(ids) == len(set(ids)), (kind, epoch)  # never twice
        assert all(len(batch) == BATCH for p in per_rank for batch in p)
        if kind == "torch":  # the fallback drops exactly the stream's last n % global_batch
            order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch)).tolist()
            assert sorted(ids) == sorted(order[: n - n % global_batch])
        else:  # shards: each worker's incomplete last batch, and a longer rank's surplus
            assert n - len(ids) < 2 * WORKERS * world * BATCH
        firsts.append(per_rank[0][0])
    assert firsts[0] != firsts[1], kind  # each epoch in its own order


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("world", "kills"), [(2, (25, 65)), (3, (0, 0))], ids=["2", "3"])
def test_streams_split_once_resume_exactly_and_match_one_process(
    tmp_path: Path, world: int, kills: tuple[int, int]
) -> None:
    results = _launch(tmp_path, world, *kills) if world == 2 else _forked(tmp_path, world)
    attempt = int(kills[0] > 0)  # the attempt after the kill resumed both streams
    for r in results:
        assert r["attempt"] == attempt
    for kind, kill in zip(("torch", "hf"), kills, strict=True):
        for rank, r in enumerate(results):
            name = f"resumed-{kind}-attempt{attempt}-rank{rank}.json"
            resumed = {
                int(s): ids for s, ids in json.loads((tmp_path / "out" / name).read_text()).items()
            }
            reference = r[f"reference-{kind}"]
            first = kill // 10 * 10 + 1  # after the last checkpoint (every 10 steps) before it
            assert min(resumed) == first and max(resumed) == TOTAL, (kind, min(resumed))
            assert all(resumed[s] == reference[s - 1] for s in resumed), kind
        _check_epochs(results, kind, world)
    reference = _one_process_reference(world)
    for r in results:
        params = torch.tensor(r["params"])
        assert (params - reference).abs().max().item() < 1e-5
        assert r["params"] == results[0]["params"]
        assert r["refused"] is not None and "different sample on different ranks" in r["refused"]
    assert (reference - flat_params(make_model())).abs().max() > 1e-3  # training moved them
