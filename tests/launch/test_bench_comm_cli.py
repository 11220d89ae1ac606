"""bench comm for real, through the CLI: each row printed once, files only where asked."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from jobs import subprocess_env


def test_rows_once_and_no_files_unless_asked(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "manygpu", "bench", "comm", "--nproc-per-node", "2",
           "--ops", "all_reduce,broadcast", "--algorithms", "native,ring",
           "--min-bytes", "64", "--max-bytes", "256", "--iters", "2", "--warmup", "1"]  # fmt: skip
    env = subprocess_env() | {"CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []  # no bench/results/comm.json in the current directory
    rows = Counter(
        (m.group(1), m.group(2), m.group(3))
        for line in res.stdout.splitlines()
        if (m := re.match(r"\s*(all_reduce|broadcast)\s+(native|ring)\s+(\d+ B)\s", line))
    )
    # 3 sizes x (2 all-reduce algorithms + broadcast), each exactly once.
    assert len(rows) == 9 and set(rows.values()) == {1}, res.stdout
    assert res.stdout.count("busbw") == 1 and "wrote" not in res.stdout
