"""Host memory of a model bigger than its share: 1 GB under fsdp at 4 ranks, as a user's job.

``bench/prepare_memory.py`` starts 4 ranks with ``manygpu launch`` (no allocator
setting of the test's own: what manygpu sets, it sets itself), each building a
GPT of 1 GB of fp32 parameters under ``par.init_module()`` and preparing it
with ``weights=`` a safetensors file of it, then one forward, backward and SGD
step. Each rank's peak resident set (``VmHWM``) above its own baseline (taken
before the model is built) must stay at most 0.7x the model's bytes: its
parameters and gradients alone are 0.5x; building the model whole first, as
before ``init_module``, peaks at 1.54x. Measured: prepare and the load peak at
0.30x, the forward at 0.48x, the backward at 0.66x: 0.5x of parameters and
gradients, the tied embedding gathered with its whole gradient (0.05x), one
block gathered with its unsharded gradients, the activations. FSDP2's CPU
defaults made it 0.77x (a prefetched block, gloo's copy of each reduce-scatter
input and the kept input, freed activations left in the heap); manygpu turns
them off on a CPU mesh (``strategies/fsdp/host.py``, BENCHMARKS.md).

Each rank is also capped (a memory cgroup of its own, where the machine has one)
at what it holds when it starts plus 0.85 GB, less than the whole model: it still
prepares and trains, its cgroup's peak within the cap. One launch serves both.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
from pathlib import Path

import memlimit
import pytest
from jobs import subprocess_env

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench" / "prepare_memory.py"
LIMIT = 0.7  # measured 0.66 (module docstring)
CAP_EXTRA = int(0.85e9)
"""What each capped rank may add to what it holds at its start: under the model's bytes."""


def _bench(tmp_path: Path, *extra: str) -> dict[str, object]:
    out = tmp_path / "memory.json"
    cmd = [
        sys.executable, str(BENCH), "--mode", "init_module", "--strategies", "fsdp",
        "--size", "1.0", "--dim", "768", "--nproc", "4", "--out", str(out), *extra,
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=subprocess_env())
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert "note" not in row, row  # the launch failed (e.g. a rank over its cap)
    return dict(row)


def test_each_rank_capped_below_the_model_peaks_under_0_7x_through_prepare_load_and_a_step(
    tmp_path: Path,
) -> None:
    capped = not memlimit.why_not_cgroup()
    with contextlib.ExitStack() as stack:
        caps = [stack.enter_context(memlimit.memory_cap(2**40)) for _ in range(4)] if capped else []
        where = f"{caps[0].kind}:" + ",".join(str(c.cgroup) for c in caps) if caps else ""
        extra = ["--cap-groups", where, "--cap-extra", str(CAP_EXTRA)] if caps else []
        row = _bench(tmp_path, *extra)
        peaks = [cap.peak_bytes() for cap in caps]
    assert int(row["model_bytes"]) >= 0.95e9 > CAP_EXTRA  # type: ignore[call-overload]
    phases = row["phases"]
    assert set(phases) >= {"prepare+load", "forward", "backward", "step"}  # type: ignore[arg-type]
    assert float(row["ratio"]) <= LIMIT, json.dumps(row["phases"])  # type: ignore[arg-type]
    assert row["allocator_env"] == {}  # nothing of the test's own
    losses = row["losses"]
    assert len(set(losses)) == 1 and math.isfinite(losses[0]), losses  # type: ignore[arg-type]
    if not capped:
        pytest.skip(f"trained uncapped: no memory cgroup here ({memlimit.why_not_cgroup()})")
    limits = row["cap_limits"]
    assert all(isinstance(n, int) for n in limits), limits  # type: ignore[union-attr]
    assert all(p is None or p <= n for p, n in zip(peaks, limits, strict=True)), (peaks, limits)  # type: ignore[arg-type]
