"""Host memory of a model bigger than its share: 1 GB under fsdp at 4 ranks, as a user's job.

``bench/prepare_memory.py`` starts 4 ranks with ``manygpu launch`` (no allocator
setting of the test's own: what manygpu sets, it sets itself), each building a
GPT of 1 GB of fp32 parameters under ``par.init_module()`` and preparing it
with ``weights=`` a safetensors file of it, then one forward, backward and SGD
step. Each rank's peak resident set (``VmHWM``) above its own baseline (taken
before the model is built) must stay at most 0.7x the model's bytes: its
parameters and gradients alone are 0.5x; building the model whole first, as
before ``init_module``, peaks above 1.5x.

The cap test: a rank whose cgroup allows less memory than the whole model
(its baseline plus 0.9x the model) still prepares and trains.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import subprocess_env

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench" / "prepare_memory.py"
LIMIT = 0.7


def _bench(tmp_path: Path, *extra: str) -> dict[str, object]:
    out = tmp_path / "memory.json"
    cmd = [
        sys.executable, str(BENCH), "--mode", "init_module", "--strategies", "fsdp",
        "--size", "1.0", "--dim", "768", "--nproc", "4", "--out", str(out), *extra,
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=subprocess_env())
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    return dict(row)


def test_each_rank_peaks_under_0_7x_the_model_through_prepare_load_and_a_step(
    tmp_path: Path,
) -> None:
    row = _bench(tmp_path)
    assert int(row["model_bytes"]) >= 0.95e9  # type: ignore[call-overload]
    phases = row["phases"]
    assert set(phases) >= {"prepare+load", "forward", "backward", "step"}  # type: ignore[arg-type]
    assert float(row["ratio"]) <= LIMIT, json.dumps(row["phases"])  # type: ignore[arg-type]
    assert row["allocator_env"] == {}  # nothing of the test's own
