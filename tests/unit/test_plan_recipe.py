"""What ``manygpu plan`` prints: no ``nan``, the sizes as one text, the ``Parallel(...)`` line."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

import manygpu
from manygpu.cli.main import main
from manygpu.cli.plan import table as plan_table
from manygpu.core.config import ParallelConfig
from manygpu.plan.desc import ModelDesc, transformer
from manygpu.plan.devices import cpu_device
from manygpu.plan.hardware import Cluster, preset
from manygpu.plan.recommend import recommend
from manygpu.strategies.registry import card

SEVEN_B = ["plan", "--params", "7e9", "--cluster", "h100"]


def test_params_alone_print_no_nan_and_call_nothing_fastest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    assert main([*SEVEN_B, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "nan" not in text.lower() and "fastest" not in text
    said = [line for line in text.splitlines() if "speed not estimated" in line]
    assert len(said) == 1 and "--layers, --hidden and --seq" in said[0]
    assert "ranked by memory fit only" in said[0]
    assert "exposed" not in text and "n/a" not in text  # no speed columns: nothing timed
    plan = json.loads(out.read_text())["plan"]  # strict JSON: null, not NaN
    assert plan["samples_per_s"] is None and plan["efficiency"] is None


def test_the_header_names_the_model_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(SEVEN_B) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "model model" not in head
    assert head.startswith("model: custom, 7,000.00M parameters; cluster: 8x H100")


def test_the_recommendation_prints_the_parallel_line_it_counted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(SEVEN_B) == 0
    text = capsys.readouterr().out
    # bf16 on an H100: ZeRO-2 fits only with 16-bit gathers; the line says so.
    assert "recommended: zero2 (dp 8)" in text
    assert 'run it with: Parallel(strategy=Zero2(param_dtype="bf16"), precision="bf16")' in text


def test_fp32_on_a_cpu_is_plain_fp32_and_strict_where_tf32_exists() -> None:
    desc = transformer("t", parameters=10**8, layers=8, hidden=768, seq_len=256)
    cpu = Cluster(name="this machine (2 CPU processes)", gpus_per_node=2, memory_gb=16.0,
                  device=cpu_device(0.1, 16.0), peak_tflops=0.1, intra_bw_gbs=2.0,
                  intra_latency_us=50.0, inter_bw_gbs=2.0, inter_latency_us=50.0,
                  overlap=False)  # fmt: skip
    on_cpu = recommend(desc, cpu, batch=2, precision="fp32")
    assert on_cpu.parallel_line.endswith('precision="fp32")'), on_cpu.parallel_line
    on_gpu = recommend(desc, preset("h100"), batch=2, precision="fp32")
    assert on_gpu.parallel_line.endswith('precision="fp32-strict")'), on_gpu.parallel_line


def test_the_tables_headers_are_never_cut() -> None:
    from rich.console import Console

    desc = transformer("t", parameters=10**9, layers=16, hidden=2048, seq_len=512)
    plan = recommend(desc, preset("h100"), batch=1, precision="bf16")
    texts = {}
    for width in (160, 120):  # a header a word a line: 160 columns hold the whole table
        console = Console(width=width, record=True, file=io.StringIO())
        console.print(plan_table(plan))
        texts[width] = console.export_text()
        assert "…" not in texts[width], texts[width]  # narrower: folded, nothing cut
    for word in ("gathered", "checkpointing", "efficiency", "samples/s"):
        assert word in texts[160]


def _runs(line: str) -> ParallelConfig:
    """The printed line, with ParallelConfig standing in for Parallel (no job starts)."""
    names = {n: getattr(manygpu, n) for n in manygpu.__all__} | {"Parallel": ParallelConfig}
    config = eval(line, names)
    assert isinstance(config, ParallelConfig)
    return config


@pytest.mark.parametrize("precision", ["bf16", "fp32", "tf32"])
def test_every_candidates_line_is_a_valid_config_of_what_was_counted(precision: str) -> None:
    desc = transformer("t", parameters=10**9, layers=16, hidden=2048, seq_len=512)
    plan = recommend(desc, preset("h100", nodes=2), batch=1, precision=precision)
    chosen = [c for c in plan.candidates if c.strategy == plan.strategy and c.recipe.layout()
              == plan.layout]  # fmt: skip
    assert [c.recipe.parallel_line() for c in chosen] == [plan.parallel_line]
    for c in plan.candidates:
        r = c.recipe
        config = _runs(r.parallel_line())
        spec = config.strategy_object(config.resolved_strategy(16))
        assert spec.name == c.strategy
        if card(c.strategy).memory.compute_dtype_option:
            want = precision if precision == "bf16" else None
            assert spec.param_dtype == want
        mesh = config.mesh
        if mesh is not None:  # the layout text and the mesh are the same sizes
            sizes = {k: v for k, v in mesh.sizes().items() if v > 1 or k == "dp"}
            assert r.layout() == " x ".join(f"{k} {v}" for k, v in sizes.items())
        assert (
            config.precision == {"bf16": "bf16", "fp32": "fp32-strict", "tf32": "fp32"}[precision]
        )


def test_layout_and_the_recommended_sizes_agree() -> None:
    desc = transformer("70b", parameters=70_000_000_000, layers=80, hidden=8192, seq_len=512)
    plan = recommend(desc, preset("h100", nodes=4), batch=1, precision="bf16")
    assert f"dp {plan.data_parallel}" in plan.layout
    for c in plan.candidates:
        r = c.recipe
        if not card(c.strategy).serves:
            assert r.data_parallel * r.pipeline_parallel * r.tensor_parallel == 32
            assert f"dp {r.data_parallel}" in r.layout()
        else:
            assert r.layout() == f"{c.ways} ps + {32 - c.ways} workers"


def test_an_untimed_pick_is_the_simplest_that_fits() -> None:
    plan = recommend(ModelDesc(name="m", parameters=10**6), preset("h100"), batch=1)
    assert plan.strategy == "ddp" and plan.samples_per_s is None and plan.step_s is None
    assert "simplest that fits" in plan.reason and "fastest" not in plan.reason
