"""bench/gpu_defaults.py's pure parts: which variants run, ratios per round, targets."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gd = _load("gpu_defaults")
worker = _load("gpu_defaults_worker")


def _run(model: str, rnd: int, variant: str, rate: float, mfu: float | None = None) -> Any:
    result = {"units_per_s": rate, "unit": "tokens", "mfu": mfu, "precision": "bf16"}
    return gd.RunRecord(model, rnd, 0, variant, True, 1.0, result=result)


def test_every_variant_has_a_setup_in_the_worker() -> None:
    assert set(gd.BY_NAME) == set(worker.SETUPS)
    assert set(gd.GPU_MODELS) | set(gd.CPU_MODELS) == set(worker.MODELS)
    assert set(gd.CPU_VARIANTS) <= set(gd.BY_NAME)


def test_what_runs_where() -> None:
    runnable, skipped = gd.split_available(("classic", "hand", "hand_compile", "manygpu"), cpu=True)
    assert [v.name for v in runnable] == ["classic", "manygpu"]
    assert "GPU techniques" in skipped["hand"] and "GPU techniques" in skipped["hand_compile"]
    runnable, _ = gd.split_available(("classic", "hand"), cpu=False)
    assert [v.name for v in runnable] == ["classic", "hand"]
    # An option this manygpu's Parallel lacks is a skip with the reason, not a crash.
    assert gd.parallel_supports((("precision", "bf16"),)) is None
    assert "no warp_drive= option" in gd.parallel_supports((("warp_drive", True),))
    assert "no precision='fp4'" in gd.parallel_supports((("precision", "fp4"),))


def test_ratios_are_medians_of_per_round_ratios() -> None:
    runs = [
        _run("m", 1, "classic", 100.0), _run("m", 1, "manygpu", 700.0, 0.3),
        _run("m", 2, "classic", 50.0), _run("m", 2, "manygpu", 300.0, 0.2),
        _run("m", 3, "classic", 100.0), _run("m", 3, "manygpu", 500.0, 0.25),
    ]  # fmt: skip
    variants = [gd.BY_NAME["classic"], gd.BY_NAME["manygpu"]]
    classic, many = gd.summarize(runs, ("m",), variants)
    assert many.ratios == {"classic": pytest.approx(6.0)}  # median of 7, 6, 5
    assert many.median_rate == 500.0 and many.mfu == 0.25 and many.runs_ok == 3
    assert classic.ratios == {}  # not compared with itself


def test_targets_say_met_not_met_or_not_measured() -> None:
    runs = [_run("gpt-124m", 1, "classic", 100.0), _run("gpt-124m", 1, "manygpu", 500.0)]
    variants = [gd.BY_NAME["classic"], gd.BY_NAME["manygpu"]]
    summaries = gd.summarize(runs, ("gpt-124m",), variants)
    ckpt = {"async_stall_s": 0.5, "blocking_save_s": 12.0, "torch_save_s": 10.0}
    got = {t["target"]: t for t in gd.targets(summaries, ckpt, cpu=False)}
    assert got["gpt-124m: defaults vs classic"]["met"] is False  # 5x < 6x
    stall, blocking = (
        got["checkpoint: async save stall (s)"],
        got["checkpoint: blocking save / torch.save"],
    )
    assert (stall["op"], stall["goal"], stall["met"]) == ("<=", 1.0, True)
    assert (blocking["op"], blocking["goal"], blocking["met"]) == ("<=", 1.1, False)
    assert blocking["value"] == pytest.approx(1.2)
    assert got["gpt-124m: defaults vs classic"]["op"] == ">="
    assert got["gpt-355m: compile=True MFU"]["met"] is None


def test_fp8_row_runs_on_gpt_355m_only_where_the_gpu_has_fp8() -> None:
    names = ("manygpu_bf16", "manygpu_fp8")
    runnable, skipped = gd.split_available(names, cpu=False, capability=(8, 0))  # A100
    assert [v.name for v in runnable] == ["manygpu_bf16"]
    assert skipped["manygpu_fp8"] == (
        "needs FP8 tensor cores (compute capability 8.9+); this GPU has compute capability 8.0"
    )
    _, skipped = gd.split_available(names, cpu=True)
    assert "GPU techniques" in skipped["manygpu_fp8"]
    runnable, _ = gd.split_available(names, cpu=False, capability=(9, 0))  # H100
    assert [v.name for v in runnable] == ["manygpu_bf16", "manygpu_fp8"]
    jobs = gd.round_jobs(gd.GPU_MODELS, list(names), 1)
    assert ("gpt-355m", "manygpu_fp8") in jobs and ("gpt-124m", "manygpu_bf16") in jobs
    assert [m for m, v in jobs if v == "manygpu_fp8"] == ["gpt-355m"]
    runs = [_run("gpt-355m", 1, "manygpu_bf16", 100.0), _run("gpt-355m", 1, "manygpu_fp8", 125.0)]
    summaries = gd.summarize(runs, ("gpt-124m", "gpt-355m"), runnable)
    assert [(x.model, x.variant) for x in summaries] == [
        ("gpt-124m", "manygpu_bf16"), ("gpt-355m", "manygpu_bf16"), ("gpt-355m", "manygpu_fp8"),
    ]  # fmt: skip
    got = {t["target"]: t for t in gd.targets(summaries, {}, cpu=False)}
    assert got["gpt-355m: fp8 vs bf16"]["value"] == pytest.approx(1.25)
    assert got["gpt-355m: fp8 vs bf16"]["met"] is True


def test_checkpointing_rows_cost_time_and_save_memory_on_gpt_355m_on_a_gpu_only() -> None:
    names = ("manygpu_bf16", "manygpu_ac_full", "manygpu_ac_selective")
    _, skipped = gd.split_available(names, cpu=True)
    assert skipped["manygpu_ac_full"] == "measures GPU step time and peak GPU memory on GPT-2 355M"
    runnable, _ = gd.split_available(names, cpu=False, capability=(8, 0))
    assert [v.name for v in runnable] == list(names)
    assert {m for m, v in gd.round_jobs(gd.GPU_MODELS, list(names), 1) if v != "manygpu_bf16"} == {
        "gpt-355m"
    }
    runs = [_run("gpt-355m", 1, v, rate) for v, rate in (("manygpu_bf16", 100.0), (names[1], 75.0))]
    runs[0].result["peak_memory_gb"], runs[1].result["peak_memory_gb"] = 60.0, 20.0
    full = gd.summarize(runs, ("gpt-355m",), runnable)[1]
    assert full.ratios == {"manygpu_bf16": 0.75} and full.peak_memory_gb == 20.0
    assert "peak GB" in [c.header for c in gd.render_tables([full], ["manygpu_bf16"])[0].columns]
