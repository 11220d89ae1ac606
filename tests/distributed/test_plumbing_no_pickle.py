"""manygpu's own cross-rank plumbing unpickles nothing, on real gloo ranks.

Each rank replaces pickle's loaders (and torch's object-collective helpers)
with functions that raise, then runs what used to pickle: checkpoint saves
(blocking and asynchronous) and resumes (the file tables, the save's
verdicts, the resume decision), a pipeline step and an evaluation that
returns the last stage's output (its shape and dtype), and the doctor's
per-rank program with its live test (the facts and the pair results
gathered, the exit code broadcast). The JSON collectives also run on a gloo
side group, where a rank that sends bytes that are not JSON is named.
"""

from __future__ import annotations

import json
import pickle
import traceback
from pathlib import Path
from typing import Any

import torch
from ckpt_job import train
from dist_harness import run_ranks
from torch import nn

from manygpu import Parallel
from manygpu.strategies import Pipeline

_LOADERS = [
    (pickle, "loads"),
    (pickle, "load"),
    (pickle, "Unpickler"),
    (torch.distributed.distributed_c10d, "_unpickler"),
    (torch.distributed.distributed_c10d, "_object_to_tensor"),
    (torch.distributed.distributed_c10d, "_tensor_to_object"),
]


_PIPELINING = "torch/distributed/pipelining/"
"""torch's pipelining engine sends its stages' tensor metadata with
``send_object_list`` while it infers shapes at the first step: torch's pickles,
not manygpu's, so the pipeline test lets them through (and nothing else)."""


def _refuser(original: Any, engine: str) -> Any:
    def refuse(*args: object, **kwargs: object) -> Any:
        if engine and any(engine in frame.filename for frame in traceback.extract_stack()):
            return original(*args, **kwargs)
        raise AssertionError("manygpu unpickled or pickled an object between ranks")

    return refuse


def _without_pickle(engine: str, job: Any, *args: Any) -> Any:
    """``job(*args)`` with pickle unusable, except below frames of torch's ``engine``
    (a path fragment; empty: nowhere)."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in _LOADERS]
    for owner, name, original in saved:
        setattr(owner, name, _refuser(original, engine))
    try:
        return job(*args)
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _checkpoint(directory: str) -> dict[str, Any]:
    par = Parallel(strategy="ddp")
    try:
        out = {}
        for mode, async_save in (("blocking", False), ("async", True)):
            where = f"{directory}/{mode}"
            first, _ = train(par, where, 4, every=2, async_save=async_save)  # saves 2 and 4
            resumed, params = train(par, where, 6, every=2, async_save=async_save)  # from 4
            out[mode] = {"first": sorted(first), "resumed": sorted(resumed), "params": params}
        return out
    finally:
        par.close()


def _pipeline() -> dict[str, Any]:
    par = Parallel(strategy=Pipeline(loss_fn=nn.functional.mse_loss, microbatches=2))
    try:
        torch.manual_seed(0)
        model = par.prepare(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)))
        opt = par.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = torch.randn(4, 4), torch.randn(4, 3)
        loss = model(x, target=y)
        par.backward(loss)
        opt.step()
        model.eval()
        with torch.no_grad():
            out = model(x.double().float())
        return {"loss": loss.item(), "shape": list(out.shape), "dtype": str(out.dtype)}
    finally:
        par.close()


def _doctor(out: str) -> int:
    from manygpu.doctor.config import LiveConfig
    from manygpu.doctor.live import run

    return run(LiveConfig(format="none", out=out, nbytes=1024, op_timeout_s=20.0))


def test_checkpoint_save_and_resume_never_unpickle(tmp_path: Path) -> None:
    results = run_ranks(_without_pickle, 2, "", _checkpoint, str(tmp_path), timeout=150)
    for out in results:
        for mode in ("blocking", "async"):
            run = out[mode]
            assert run["first"] == [1, 2, 3, 4] and run["resumed"] == [5, 6], (mode, run)
            assert torch.equal(run["params"], results[0][mode]["params"])
    # Blocking and asynchronous saves resume alike (bitwise on CPU fp32).
    assert torch.equal(results[0]["blocking"]["params"], results[0]["async"]["params"])


def test_pipeline_step_and_outputs_never_unpickle() -> None:
    results = run_ranks(_without_pickle, 2, _PIPELINING, _pipeline, timeout=120)
    assert results[0] == results[1]
    assert results[0]["shape"] == [4, 3] and results[0]["dtype"] == "torch.float32"


def test_doctor_live_check_never_unpickles(tmp_path: Path) -> None:
    report = tmp_path / "doctor.json"
    assert run_ranks(_without_pickle, 2, "", _doctor, str(report), timeout=120) == [0, 0]
    live = json.loads(report.read_text())["live"]
    assert live["world_size"] == 2 and len(live["hosts"]) == 2
    assert [(p["a"], p["b"]) for p in live["pairs"]] == [(0, 1)]
    assert live["pairs"][0]["error"] is None and live["pairs"][0]["gbps"] > 0


def _side_group() -> dict[str, Any]:
    """The JSON collectives over a gloo group of their own (as the checkpoint's are);
    rank 1 then sends bytes that are not JSON."""
    import torch.distributed as dist

    from manygpu.comm import objects

    dist.init_process_group("gloo")
    group = dist.new_group(backend="gloo")
    r = dist.get_rank()
    out: dict[str, Any] = {
        "gathered": objects.all_gather_json({"rank": r, "t": (r, "x")}, group=group),
        "from_1": objects.broadcast_json(["sent by", r], 1, group=group),
    }
    if r == 1:
        objects._encode = lambda obj: b"\x80\x04\x95 not json"  # a pickle's first bytes
    try:
        objects.all_gather_json({"rank": r}, operation="probe", group=group)
        out["garbage"] = "no error"
    except objects.PayloadError as exc:
        out["garbage"] = str(exc)
    return out


def test_json_collectives_on_a_side_group_name_the_sender() -> None:
    results = run_ranks(_without_pickle, 2, "", _side_group, timeout=60)
    for r, out in enumerate(results):
        assert out["gathered"] == [{"rank": 0, "t": [0, "x"]}, {"rank": 1, "t": [1, "x"]}]
        assert out["from_1"] == ["sent by", 1]
        assert out["garbage"].startswith(f"rank {r}: probe: rank 1 sent a malformed payload (")
