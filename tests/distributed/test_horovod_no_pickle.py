"""manygpu.horovod's own plumbing unpickles nothing, on real gloo ranks.

Each rank replaces pickle's loaders (and torch's object-collective helpers)
with functions that raise, then runs what used to pickle: ``hvd.init`` (the
topology), a checked ``allreduce`` and a mismatch (the calls' descriptions),
``broadcast_optimizer_state`` (the root's layout). Then a rank sends bytes
that are not JSON, and a root a layout of the wrong structure: every rank
gets one line naming the sender, and the job goes on.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from dist_harness import preload, run_ranks
from torch import nn

preload("manygpu.horovod")

_LOADERS = [
    (pickle, "loads"),
    (pickle, "load"),
    (pickle, "Unpickler"),
    (torch.distributed.distributed_c10d, "_unpickler"),
    (torch.distributed.distributed_c10d, "_object_to_tensor"),
    (torch.distributed.distributed_c10d, "_tensor_to_object"),
]


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("manygpu.horovod unpickled or pickled an object between ranks")


def _states(hvd: Any, r: int) -> dict[str, Any]:
    """Rank 0 stepped (Adam with betas, SGD with a tensor lr); rank 1 did not."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    adam = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1), betas=(0.8, 0.9 - 0.1 * r))
    sgd = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05 * (r + 1)), momentum=0.9)
    if r == 0:
        for opt in (adam, sgd):
            model(torch.ones(4, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
    hvd.broadcast_optimizer_state(adam, root_rank=0)
    hvd.broadcast_optimizer_state(sgd, root_rank=0)
    group, sgd_group = adam.param_groups[0], sgd.param_groups[0]
    return {
        "adam": {
            k: {n: v.tolist() for n, v in s.items()} for k, s in adam.state_dict()["state"].items()
        },
        "lr": group["lr"],
        "betas": [type(group["betas"]).__name__, list(group["betas"])],
        "sgd_lr": [type(sgd_group["lr"]).__name__, float(sgd_group["lr"])],
        "momentum": [s["momentum_buffer"].tolist() for s in sgd.state.values()],
    }


def _hostile(hvd: Any, r: int) -> dict[str, str]:
    """Rank 1 sends bytes that are not JSON; rank 0 a layout of the wrong structure."""
    from manygpu.comm import PayloadError, all_gather_json, objects
    from manygpu.horovod import optimizer_state

    out = {}
    encode = objects._encode
    if r == 1:
        objects._encode = lambda obj: b"\x80\x04\x95 not json"  # a pickle's first bytes
    try:
        all_gather_json({"rank": r}, operation="probe")
        out["garbage"] = "no error"
    except PayloadError as exc:
        out["garbage"] = str(exc)
    objects._encode = encode
    if r == 0:
        optimizer_state.spec_to_json = lambda spec: {"group_sizes": "x"}
    try:
        hvd.broadcast_optimizer_state(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), 0)
        out["layout"] = "no error"
    except PayloadError as exc:
        out["layout"] = str(exc)
    out["after"] = str(hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item())  # still usable
    return out


def _without_pickle() -> dict[str, Any]:
    import manygpu.horovod as hvd

    saved = [(owner, name, getattr(owner, name)) for owner, name in _LOADERS]
    for owner, name, _ in saved:
        setattr(owner, name, _refuse)
    try:
        hvd.init()
        r = hvd.rank()
        out: dict[str, Any] = {"topology": [hvd.local_rank(), hvd.cross_rank(), hvd.cross_size()]}
        out["sum"] = hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum).item()
        try:
            hvd.allreduce(torch.ones(8 if r else 4), name="x")
            out["mismatch"] = "no error"
        except hvd.HorovodMismatchError as exc:
            out["mismatch"] = str(exc)
        out["states"] = _states(hvd, r)
        out["hostile"] = _hostile(hvd, r)
        return out
    finally:
        hvd.shutdown()
        for owner, name, value in saved:
            setattr(owner, name, value)


def test_horovod_plumbing_never_unpickles() -> None:
    results = run_ranks(_without_pickle, 2, extra_env={"MANYGPU_TIMEOUT": "20"})
    root = results[0]["states"]
    assert root["lr"] == 0.01 and root["betas"] == ["tuple", [0.8, 0.9]]
    assert root["sgd_lr"][0] == "Tensor" and abs(root["sgd_lr"][1] - 0.05) < 1e-7
    assert root["adam"] and root["momentum"] == [[[4.0] * 3] * 2, [4.0] * 2]
    for r, out in enumerate(results):
        assert out["topology"] == [r, 0, 1]  # one host: each local rank its own cross group
        assert out["sum"] == 3.0
        assert "rank 0 calls allreduce('x', float32[4]" in out["mismatch"], out["mismatch"]
        assert "rank 1 calls allreduce('x', float32[8]" in out["mismatch"], out["mismatch"]
        assert out["states"] == root
        hostile = out["hostile"]
        assert hostile["garbage"].startswith(
            f"rank {r}: probe: rank 1 sent a malformed payload ("
        ), hostile["garbage"]
        assert hostile["layout"].startswith(
            f"rank {r}: broadcast_optimizer_state: rank 0 sent a malformed payload ("
        ), hostile["layout"]
        assert "\n" not in hostile["garbage"] + hostile["layout"]
        assert hostile["after"] == "2.0"
