"""Weights straight into shards, and out of them, on real gloo ranks (manygpu.weights).

One run at 4 ranks loads one file into FSDP2 (1-D), HSDP (2-D), tensor parallel
and tensor parallel x FSDP2 (whose dp placement is a ``_StridedShard``) models
sharded directly with torch, and saves each back: every gathered tensor and
every saved tensor equals the file's exactly (loading copies; no arithmetic).
Each rank reads its share: under FSDP2 the ranks' reads add up to the file's
tensor bytes exactly (every element read once), under HSDP to two copies.
At 2 ranks under fsdp, one run loads a DCP checkpoint from disk and, from a real
S3 server on loopback (moto's), a safetensors file, a sharded directory and a
DCP step through ``prepare(weights=URL)``: each equal to loading from disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_ranks
from safetensors.torch import load_file
from torch import nn

from manygpu.weights import load_weights, save_weights


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """A tied embedding and head; 10 vocabulary rows do not split evenly over 4 ranks."""

    def __init__(self, vocab: int = 10, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight


def _shard(layout: str, model: Net) -> None:
    """Shard ``model`` in place the way the strategies do, with torch's own calls."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if layout in ("tp", "tp+fsdp"):
        shape, names = ((4,), ("tp",)) if layout == "tp" else ((2, 2), ("dp", "tp"))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)  # type: ignore[arg-type]
        if layout == "tp":
            return
        dp = mesh["dp"]
    elif layout == "hsdp":
        dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        dp = init_device_mesh("cpu", (4,))
    for block in model.blocks:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, tensor in model.state_dict().items():
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        out[name] = whole.detach().clone()
    return out


def _placements(model: nn.Module) -> list[str]:
    from torch.distributed.tensor import DTensor

    return sorted({type(p).__name__ for p in model.parameters() if isinstance(p, DTensor)
                   for p in p.placements})  # fmt: skip


def _layouts(weights: str, out: str) -> dict[str, Any]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    found: dict[str, Any] = {}
    for layout in ("fsdp", "hsdp", "tp", "tp+fsdp"):
        torch.manual_seed(100 + dist.get_rank())  # values the load must overwrite
        model = Net()
        _shard(layout, model)
        report = load_weights(model, weights)
        save_weights(model, Path(out) / layout, max_shard_bytes=400)
        found[layout] = {
            "state": _full(model),
            "bytes": report.bytes_read,
            "placements": _placements(model),
            "tied": model.head.weight is model.embed.weight,
        }
    return found


@pytest.fixture
def weights(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Net()
    path = tmp_path / "w.safetensors"
    save_weights(model, path)
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_one_file_into_every_sharded_layout_and_back(
    tmp_path: Path, weights: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    path, reference = weights
    total = sum(v.numel() * 4 for v in load_file(str(path)).values())
    ranks = run_ranks(_layouts, 4, str(path), str(tmp_path / "out"), timeout=150)
    for layout in ("fsdp", "hsdp", "tp", "tp+fsdp"):
        for rank in ranks:
            got = rank[layout]["state"]
            assert got.keys() == reference.keys(), layout
            assert all(torch.equal(got[k], reference[k]) for k in reference), layout
            assert rank[layout]["tied"], layout
        directory = tmp_path / "out" / layout
        files = list(directory.glob("*.safetensors"))
        saved = {k: v for f in files for k, v in load_file(str(f)).items()}
        assert len(files) > 1, layout
        assert saved.keys() == reference.keys() - {"head.weight"}, layout
        assert all(torch.equal(saved[k], reference[k]) for k in saved), layout
    assert "_StridedShard" in ranks[0]["tp+fsdp"]["placements"]  # the interleaved path ran
    fsdp = [r["fsdp"]["bytes"] for r in ranks]
    assert sum(fsdp) == total and max(fsdp) < 0.4 * total, fsdp  # each element read once
    hsdp = [r["hsdp"]["bytes"] for r in ranks]
    assert sum(hsdp) == 2 * total and max(hsdp) < 0.7 * total, hsdp  # two replicas


def _from_a_dcp_checkpoint(directory: str, url: str, local: str) -> dict[str, Any]:
    """Save a DCP checkpoint under fsdp, then load it into a fresh fsdp model; then
    the same loads from the S3 server at ``url``: a safetensors file and a sharded
    directory (each rank's rows by ranged reads), and a DCP step saved there."""
    from manygpu import Parallel
    from manygpu.checkpoint import Checkpointer, TrainState

    par = Parallel(strategy="fsdp", seed=0)
    try:
        torch.manual_seed(0)
        saved = par.prepare(Net())
        Checkpointer(par, directory, model=saved, format="dcp").save(TrainState(step=1))
        Checkpointer(par, f"{url}/ck", model=saved, format="dcp").save(TrainState(step=1))
        torch.manual_seed(1)
        fresh = par.prepare(Net())
        report = load_weights(par.unwrap(fresh), directory)
        assert report.source.endswith("step-00000001")
        mine, theirs = _full(par.unwrap(fresh)), _full(par.unwrap(saved))
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
        found: dict[str, Any] = {"dcp": mine}
        weights = {"disk": local, "s3": f"{url}/w.safetensors", "s3-hf": f"{url}/hf",
                   "s3-dcp": f"{url}/ck"}  # fmt: skip
        for name, where in weights.items():
            torch.manual_seed(2)
            with par.init_module():
                empty = Net()
            found[name] = _full(par.unwrap(par.prepare(empty, weights=where)))
        return found
    finally:
        par.close()


def test_a_dcp_checkpoint_and_s3_urls_load_into_shards(
    tmp_path: Path, weights: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    import fsspec
    from s3_server import BUCKET, s3_server

    path, reference = weights
    save_weights(_net_from(reference), tmp_path / "hf", max_shard_bytes=400)
    with s3_server():
        url = f"s3://{BUCKET}/weights"
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.pipe_file(f"{BUCKET}/weights/w.safetensors", path.read_bytes())
        for file in sorted((tmp_path / "hf").iterdir()):
            fs.pipe_file(f"{BUCKET}/weights/hf/{file.name}", file.read_bytes())
        ranks = run_ranks(_from_a_dcp_checkpoint, 2, str(tmp_path / "ck"), url, str(path),
                          timeout=120)  # fmt: skip
    assert all(torch.equal(ranks[0]["dcp"][k], ranks[1]["dcp"][k]) for k in ranks[0]["dcp"])
    for rank in ranks:
        for name in ("disk", "s3", "s3-hf"):  # exactly the file's values, from disk or S3
            assert all(torch.equal(rank[name][k], reference[k]) for k in reference), name
        assert all(torch.equal(rank["s3-dcp"][k], rank["dcp"][k]) for k in rank["dcp"])


def _net_from(state: dict[str, torch.Tensor]) -> Net:
    model = Net()
    model.load_state_dict(state)
    return model
