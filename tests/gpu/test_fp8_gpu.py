"""``precision="fp8"`` on a real GPU: float8 matmuls where the GPU has them, one line where not.

Marked ``gpu``; each test skips, saying why, on machines it does not apply to.
Tolerance as the CPU emulation's (tests/unit/test_fp8.py): each step's loss
within 2% of bf16 autocast.
"""

from __future__ import annotations

import pytest
import torch
from zoo import ZOO

from manygpu import Parallel
from manygpu.errors import UsageError

pytestmark = pytest.mark.gpu

CAPABILITY = torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None
HAS_FP8 = CAPABILITY is not None and CAPABILITY >= (8, 9)


def _losses(precision: str, steps: int = 4) -> tuple[list[float], dict[str, str]]:
    torch.manual_seed(0)
    entry = ZOO["gpt"]
    with Parallel(strategy="single", precision=precision) as par:
        model = entry.build()
        model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
        x, y = entry.data(steps * 8, torch.Generator().manual_seed(3))
        x, y = x.to(par.device), y.to(par.device)
        losses = []
        for i in range(steps):
            loss = entry.loss(model(x[i * 8 : (i + 1) * 8]), y[i * 8 : (i + 1) * 8])
            par.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        layers = {n: type(m).__name__ for n, m in par.unwrap(model).named_modules()}
    return losses, layers


@pytest.mark.skipif(not HAS_FP8, reason="needs a GPU with compute capability 8.9+")
def test_fp8_trains_in_float8_and_tracks_bf16() -> None:
    got, layers = _losses("fp8")
    ref, _ = _losses("bf16")
    assert layers["blocks.1.fc1"] == "Float8Linear" and layers["head"] == "Linear"
    assert got == pytest.approx(ref, rel=2e-2) and got != ref


@pytest.mark.skipif(
    CAPABILITY is None or HAS_FP8, reason="needs a GPU below compute capability 8.9"
)
def test_fp8_is_refused_in_one_line_on_an_older_gpu() -> None:
    with pytest.raises(UsageError, match=r"compute capability 8\.9\+") as err:
        Parallel(strategy="single", precision="fp8")
    assert "\n" not in str(err.value)
