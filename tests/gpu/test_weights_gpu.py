"""Weights into CUDA shards and into CPU-offloaded shards of a CUDA mesh (manygpu.weights).

FSDP2 with ``CPUOffloadPolicy`` keeps each local shard in host memory while the
mesh (and its all-gathers) is on the GPU: the load must fill the host shard in
place, and the save must gather through the GPU. Exact equality: a bf16 file
into fp32 parameters, compared with the file's values cast the same way.
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

pytestmark = [pytest.mark.gpu, pytest.mark.slow]  # slow: it starts ranks


def _net() -> nn.Module:
    return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 16), nn.Linear(16, 8))


def _on_gpu(weights: str, out: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    found: dict[str, Any] = {}
    for layout in ("plain", "fsdp", "offload"):
        torch.manual_seed(1)
        model = _net().cuda()
        if layout != "plain":
            mesh = init_device_mesh("cuda", (1,))
            offload = CPUOffloadPolicy(pin_memory=True)
            policy = {"offload_policy": offload} if layout == "offload" else {}
            for block in model:
                fully_shard(block, mesh=mesh, **policy)
            fully_shard(model, mesh=mesh, **policy)
        report = load_weights(model, weights)
        save_weights(model, Path(out) / f"{layout}.safetensors")
        params = list(model.parameters())
        local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        whole = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                 for k, v in model.state_dict().items()}  # fmt: skip
        found[layout] = {"state": whole, "devices": sorted({t.device.type for t in local}),
                         "bytes": report.bytes_read}  # fmt: skip
    return found


def test_weights_into_cuda_and_offloaded_shards(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    reference = _net()
    path = tmp_path / "w.safetensors"
    save_weights(reference, path, dtype=torch.bfloat16)
    expected = {k: v.detach().bfloat16().float() for k, v in reference.state_dict().items()}
    (found,) = run_ranks(_on_gpu, 1, str(path), str(tmp_path / "out"), timeout=300)
    assert found["plain"]["devices"] == ["cuda"] and found["fsdp"]["devices"] == ["cuda"]
    assert found["offload"]["devices"] == ["cpu"]  # the shards stayed in host memory
    for layout, got in found.items():
        assert all(torch.equal(got["state"][k], expected[k]) for k in expected), layout
        saved = load_file(str(tmp_path / "out" / f"{layout}.safetensors"))
        assert all(torch.equal(saved[k], expected[k]) for k in expected), layout
