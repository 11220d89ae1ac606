"""bench comm for real, through the CLI: every op correct, each row printed once, files
only where asked (one job serves all three)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from jobs import subprocess_env

from manygpu.cli.bench import comm_config
from manygpu.cli.main import build_parser

OPS = "all_reduce,all_gather,reduce_scatter,broadcast,reduce,all_to_all"
ROW = re.compile(rf"\s*({OPS.replace(',', '|')})\s+(native|ring|ps|tree)\s+(\d+ K?B)\s")


def test_every_op_correct_rows_once_and_files_only_where_asked(tmp_path: Path) -> None:
    out, png = tmp_path / "out" / "comm.json", tmp_path / "out" / "comm.png"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    cmd = [sys.executable, "-m", "manygpu", "bench", "comm", "--nproc-per-node", "2",
           "--ops", OPS, "--min-bytes", "64", "--max-bytes", "1K", "--iters", "2",
           "--warmup", "1", "--json", str(out), "--plot", str(png)]  # fmt: skip
    env = subprocess_env() | {"CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    # Files where --json / --plot say and nowhere else: no bench/results/comm.json in
    # the current directory, no markdown table unless --markdown asks for one.
    assert list(cwd.iterdir()) == []
    assert sorted(p.name for p in out.parent.iterdir()) == ["comm.json", "comm.png"]
    assert res.stdout.count("wrote") == 1 and f"wrote {out} and {png}" in res.stdout
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert data["world_size"] == 2 and data["memcpy_gbs"] > 0
    assert data["command"].startswith("manygpu bench comm --nproc-per-node 2")
    assert data["sweep"]["iters"] == 2 and data["sweep"]["min_bytes"] == 64
    # 5 sizes x (4 all-reduce algorithms + 5 other ops)
    assert len(rows) == 5 * 9
    assert {r["algorithm"] for r in rows if r["op"] == "all_reduce"} == {
        "native",
        "ring",
        "ps",
        "tree",
    }
    assert all(r["wrong"] == 0 for r in rows)
    for r in rows:
        factor = 0.5 if r["op"] in ("all_gather", "reduce_scatter", "all_to_all") else 1.0
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] * factor)
    assert png.read_bytes()[:4] == b"\x89PNG"
    # Each row printed exactly once (by one rank), under one header with units on each value.
    printed = Counter(m.groups() for line in res.stdout.splitlines() if (m := ROW.match(line)))
    assert len(printed) == 5 * 9 and set(printed.values()) == {1}, res.stdout
    assert res.stdout.count("busbw") == 1
    header = next(ln for ln in res.stdout.splitlines() if ln.startswith("op "))
    assert header.split()[-3:-1] == ["algbw", "busbw"], header


def test_algorithms_and_files_come_from_the_flags_alone() -> None:
    """--algorithms picks the all-reduce algorithms; without --json / --plot / --markdown
    the workers are handed no path to write (in-process: no job needed)."""
    ns = build_parser().parse_args(["bench", "comm", "--algorithms", "native,ring"])
    config = comm_config(ns)
    assert config.sweep.algorithms == ("native", "ring")
    assert (config.json_path, config.plot, config.markdown) == ("", "", "")
