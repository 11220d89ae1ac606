"""``manygpu launch`` for real: torchrun scripts, failures, hangs, bad input."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).resolve().parents[2]


def manygpu(
    *args: str, timeout: float = 90, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a user would, in a fresh process."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env |= env or {}
    return subprocess.run(
        [sys.executable, "-m", "manygpu", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=full_env,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def assert_gone(pid_dir: Path) -> None:
    """Every worker that wrote its pid has exited (no orphans)."""
    pids = [int(p.read_text()) for p in pid_dir.glob("pid*")]
    assert pids, "the workers never started"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        alive = [
            p
            for p in pids
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        if not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"worker processes {alive} outlived the job")


def test_torchrun_script_runs_unchanged_under_torchruns_flags(tmp_path: Path) -> None:
    """A plain torchrun script sees torchrun's variables, its argv and an absolute
    ``__file__``, under nanoGPT's `torchrun --standalone` (our default anyway), tee/redirects
    into --log-dir, a rank filter; and --no-python runs a program directly. Its group,
    formed, used and destroyed within one poll of the watcher, raises no false alarm, and
    the thread count the user chose reaches the workers unsaid (tests/launch/test_threads_note.py
    has the count the launcher chooses)."""
    logs = tmp_path / "logs"
    res = manygpu(
        "launch",
        "--standalone",
        "--nproc_per_node",
        "2",
        "--tee",
        "3",
        "--log-dir",
        str(logs),
        "--local-ranks-filter",
        "1",
        "--role",
        "trainer",
        "--monitor-interval",
        "0.2",
        "--run-path",
        "torchrun_style.py",  # relative: __file__ must still be absolute
        str(tmp_path),
        "--flag",
        "x",
        cwd=SCRIPTS,
        env={"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "2"},
    )
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in tmp_path.glob("rank*.json")) == ["rank0.json", "rank1.json"]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, rec in enumerate(records):
        assert rec["RANK"] == str(rank) and rec["LOCAL_RANK"] == str(rank)
        assert rec["WORLD_SIZE"] == "2" and rec["LOCAL_WORLD_SIZE"] == "2"
        assert rec["GROUP_RANK"] == "0" and rec["MASTER_ADDR"] and rec["MASTER_PORT"]
        assert rec["sum"] == 3.0
        assert rec["argv"] == [str(tmp_path), "--flag", "x"]
        assert rec["file"] == str(SCRIPTS / "torchrun_style.py")  # absolute, as under torchrun
        assert rec["OMP_NUM_THREADS"] == "2"  # the user's, not the launcher's 1 per worker
    assert len(list(logs.rglob("stdout.log"))) == 2  # tee'd into the kept log directory
    # No "never formed a process group" for a group destroyed before the end (the Flight
    # Recorder still knows it), no OMP_NUM_THREADS note: no line of ours at all.
    assert [ln for ln in res.stderr.splitlines() if ln.startswith("manygpu:")] == [], res.stderr
    out = tmp_path / "np"
    out.mkdir()
    res = manygpu(
        "launch",
        "--nproc-per-node",
        "2",
        "--no-python",
        "sh",
        "-c",
        f'echo "$RANK/$WORLD_SIZE" > {out}/r$RANK',
    )
    assert res.returncode == 0, res.stderr
    assert [(out / f"r{r}").read_text().strip() for r in range(2)] == ["0/2", "1/2"]


def test_module_launch(tmp_path: Path) -> None:
    res = manygpu(
        "launch", "--nproc-per-node", "2", "-m", "pkg.job", str(tmp_path), "a", cwd=SCRIPTS
    )
    assert res.returncode == 0, res.stderr
    for rank in range(2):
        text = (tmp_path / f"module-rank{rank}").read_text()
        assert text.startswith("__main__ ") and text.endswith(f"{tmp_path} a")


def test_failing_rank_exception_propagates(tmp_path: Path) -> None:
    res = manygpu(
        "launch", "--nproc-per-node", "2", str(SCRIPTS / "fails.py"), "raise", str(tmp_path)
    )
    assert res.returncode == 1
    assert "rank 1 failed with exit code 1: ValueError: boom from the failing rank" in res.stderr
    assert "[rank1]:Traceback" in res.stderr  # the worker's own traceback, prefixed
    assert_gone(tmp_path)


def test_failing_rank_exit_code_propagates(tmp_path: Path) -> None:
    res = manygpu("launch", "--nproc-per-node", "2", str(SCRIPTS / "fails.py"), "7", str(tmp_path))
    assert res.returncode == 7, res.stderr
    assert "rank 1 failed with exit code 7" in res.stderr
    assert_gone(tmp_path)


# Three ranks, so the first failure is told apart from two consequences (the failing rank
# the last or a middle one); at two ranks, an exception and an exit code are the tests
# just above (the other rank outside any collective).
@pytest.mark.parametrize(
    "world, failing, mode, code, words",
    [
        (3, 2, "raise", 1, "failed with exit code 1: ValueError: boom from rank 2"),
        (3, 1, "5", 5, "failed with exit code 5"),
        (3, 2, "kill", 137, "was killed by SIGKILL"),
    ],
)
def test_the_first_failure_in_time_is_blamed_with_its_exit_code(
    world: int, failing: int, mode: str, code: int, words: str
) -> None:
    res = manygpu(
        "launch",
        "--nproc-per-node",
        str(world),
        "--timeout",
        "30",
        str(SCRIPTS / "fails_in_collective.py"),
        mode,
        str(failing),
        env={"PYTHONPATH": str(ROOT / "src")},
    )
    summary = [ln for ln in res.stderr.splitlines() if ln.startswith("manygpu:")]
    assert res.returncode == code, res.stderr
    assert summary[0].startswith(f"manygpu: rank {failing} {words}"), summary
    # The others (as many as the agent saw fail before it stopped them) come after it.
    assert all("then (a consequence)" in ln for ln in summary[1:]), summary
    assert all(f"rank {failing} " not in ln for ln in summary[1:]), summary
    # A peer's death is said as such: no backend traceback (MANYGPU_TRACEBACK=1 shows it),
    # only the failing rank's own, and the consequences' lost collective is no timeout.
    assert "GLHF" not in res.stderr and "did not complete within" not in res.stderr
    assert res.stderr.count("Traceback") == (1 if mode == "raise" else 0), res.stderr
    assert all("PeerLostError" in ln for ln in summary[1:] if "exit code 1" in ln), summary


def test_a_plain_torchrun_scripts_hang_gets_a_verdict_and_only_its_evidence_is_left(
    tmp_path: Path,
) -> None:
    """--timeout becomes the default process-group timeout of any script, and before
    it ends the waiting rank the verdict names the rank that never came and its line.
    The launcher's own log directory is removed (torch would leave torchelastic_* in
    TMPDIR); the evidence directory the verdict names is kept."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    start = time.monotonic()
    res = manygpu(
        "launch",
        "--nproc-per-node",
        "2",
        "--timeout",
        "5",
        str(SCRIPTS / "plain_hang.py"),
        env={"TMPDIR": str(tmp)},
    )
    elapsed = time.monotonic() - start
    assert res.returncode == 124, res.stderr
    assert elapsed < 5 + 30, f"took {elapsed:.1f}s"
    lines = [line for line in res.stderr.splitlines() if line.startswith("manygpu:")]
    assert lines[0].startswith("manygpu: hang: rank 1 (host ") and lines[0].endswith(
        ") never entered all_reduce #1 that rank 0 waits in; rank 1 is at plain_hang.py:10"
    ), lines
    left = [p.name for p in tmp.iterdir() if p.name.startswith(("torchelastic_", "manygpu-"))]
    assert len(left) == 1 and left[0].startswith("manygpu-evidence-"), left
    assert (
        lines[1] == f"manygpu: evidence (stacks and collective records per rank): {tmp / left[0]}"
    )
    record = json.loads((tmp / left[0] / "verdict.json").read_text())
    assert record["rank"] == 1 and {r["rank"] for r in record["ranks"]} == {0, 1}
    # The verdict's own SIGTERM stopped the workers: no one else sent one.
    assert lines[2] == "manygpu: stopped after the hang verdict; stopped 2 workers", lines


def test_hung_rank_ends_within_timeout(tmp_path: Path) -> None:
    """manygpu's own collective: the verdict comes before its timeout would end rank 0."""
    timeout = 5
    start = time.monotonic()
    res = manygpu(
        "launch",
        "--nproc-per-node",
        "2",
        "--timeout",
        str(timeout),
        str(SCRIPTS / "hangs.py"),
        str(tmp_path),
        env={"PYTHONPATH": str(ROOT / "src")},
    )
    elapsed = time.monotonic() - start
    assert res.returncode == 124, res.stderr
    # Start-up (two torch imports on 2 cores) + timeout + stopping the other rank.
    assert elapsed < timeout + 25, f"took {elapsed:.1f}s"
    assert "never entered all_reduce #1 that rank 0 waits in; rank 1 is at hangs.py:17" in (
        res.stderr
    )
    assert_gone(tmp_path)


def test_a_worker_stuck_at_exit_is_ended_and_counts_as_a_success(tmp_path: Path) -> None:
    """Rank 1 hangs in an atexit handler holding the GIL, after its script returned:
    it is ended MANYGPU_EXIT_GRACE seconds later with its stacks shown, the job
    succeeds, and the script's non-daemon threads still finished their work."""
    start = time.monotonic()
    res = manygpu(
        "launch",
        "--nproc-per-node",
        "2",
        str(SCRIPTS / "hangs_at_exit.py"),
        str(tmp_path),
        env={"MANYGPU_EXIT_GRACE": "8"},  # rank 0 exits well within it, even under load
    )
    elapsed = time.monotonic() - start
    assert res.returncode == 0, res.stderr
    assert elapsed < 60, f"took {elapsed:.1f}s"
    assert "rank 1: the script returned, but the process was still running 8s later" in res.stderr
    assert "sleep" in res.stderr or "<lambda>" in res.stderr  # the stuck thread's stack
    assert "rank 0: the script returned" not in res.stderr
    assert sorted(p.name for p in tmp_path.glob("thread-*")) == ["thread-0", "thread-1"]
    assert_gone(tmp_path)


def test_a_rank_that_dies_after_its_script_returned_is_said_to(tmp_path: Path) -> None:
    """The script's work is done, then its process aborts in the interpreter's shutdown
    (a daemon thread in a store call): the job fails with 134, and the line says the
    script had returned and what aborts there, not only "killed by SIGABRT"."""
    res = manygpu("launch", "--nproc-per-node", "1", str(SCRIPTS / "aborts_at_exit.py"),
                  str(tmp_path))  # fmt: skip
    summary = [ln for ln in res.stderr.splitlines() if ln.startswith("manygpu: rank")]
    assert res.returncode == 134, res.stderr[-3000:]
    assert (tmp_path / "done0").read_text() == "done"
    assert summary == [
        f"manygpu: rank 0 was killed by SIGABRT (pid {(tmp_path / 'pid0').read_text()}) after "
        "its script had returned: in the interpreter's shutdown, a daemon thread still in "
        "native code or a native destructor"
    ], res.stderr[-3000:]
    assert_gone(tmp_path)


def test_a_finished_job_exits_as_plain_python_would(tmp_path: Path) -> None:
    """Idle non-daemon pools held by modules (ours, and inductor's async compile on
    an empty cache) do not keep a finished worker alive: the exit hooks that tell
    pool threads to quit run before the threads are joined. The job exits at once,
    not through the exit timer (its line would name the rank). One worker holds both
    pools (either alone would keep it alive); a second would only compile the same
    kernels again. The worker froze torch's objects out of the collector as torch
    loaded (runtime/heap.py), yet Python's last collection still flushed a file the
    script left open in a reference cycle."""
    cache = tmp_path / "inductor-cache"
    res = manygpu(
        "launch",
        "--nproc-per-node",
        "1",
        str(SCRIPTS / "exits_like_python.py"),
        str(tmp_path),
        "compile,pool,cycle",
        env={"MANYGPU_EXIT_GRACE": "60", "TORCHINDUCTOR_CACHE_DIR": str(cache)},
    )
    ended = time.time()
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("done*")) == ["done0"]
    assert "the script returned, but the process was still running" not in res.stderr
    # From the script's end (compiling takes what the load allows) to the job's: well
    # under the 60 s exit timer.
    after = ended - (tmp_path / "done0").stat().st_mtime
    assert after < 40, f"{after:.1f}s after the script ended: the exit timer ended it"
    assert any(cache.rglob("*.so")), "inductor compiled nothing: the test proves nothing"
    assert (tmp_path / "pool0").read_text() == "held", "our pool was never made"
    assert int((tmp_path / "frozen0").read_text()) > 50_000  # torch's objects (~175,000)
    assert (tmp_path / "cycle0").read_text() == "flushed at exit"
    assert_gone(tmp_path)


def _one_line_error(res: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_bad_input_gives_one_line_and_exit_2() -> None:
    """Through a real process: one line, exit 2, no traceback from the interpreter.

    The other bad inputs (launch, demo, bench, plan, ...) are checked the same way
    in-process, in tests/unit/test_bad_input.py.
    """
    script = str(SCRIPTS / "torchrun_style.py")
    _one_line_error(manygpu("launch", "--gpus", "0,x", script), "--gpus", "0,x")
    _one_line_error(manygpu("demo", "--strategy", "nope"), "unknown strategy 'nope'", "ddp")


def test_a_missing_peer_node_ends_within_the_wait_in_one_line(tmp_path: Path) -> None:
    start = time.monotonic()
    res = manygpu(
        "launch",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "--timeout",
        "5",
        str(SCRIPTS / "torchrun_style.py"),
        str(tmp_path),
    )
    assert res.returncode == 1, res.stderr
    assert time.monotonic() - start < 5 + 30
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("manygpu: only 1 of 2 nodes joined"), lines


def test_master_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        res = manygpu(
            "launch",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            str(SCRIPTS / "torchrun_style.py"),
            str(tmp_path),
        )
    _one_line_error(res, f"master port {port}", "already in use")


def test_demo_reaches_accuracy(tmp_path: Path) -> None:
    """Three epochs: the accuracy target is met (the seeded run reaches 0.956 there),
    and two timing windows, whose median is their mean."""
    out = tmp_path / "demo.json"
    res = manygpu("demo", "--epochs", "3", "--json", str(out), timeout=170)
    assert res.returncode == 0, res.stderr
    result = json.loads(out.read_text())
    assert result["workers"] == 2 and result["strategy"] == "ddp"
    assert result["accuracies"][-1] >= 0.95
    assert result["speedup"] > 0 and "scaling efficiency" in res.stdout
    # It speaks first, before PyTorch and the workers start; then it launches.
    first, second = res.stdout.splitlines()[:2]
    assert first.startswith("manygpu demo: training a small CNN")
    assert "2 epoch(s) are timed" in first
    assert second == "manygpu demo: launching 2 worker process(es)"
    # The speed-up is the median of one window per epoch after the first, with its range.
    windows, spread = result["windows"], result["speedup_spread"]
    assert len(windows) == spread["windows"] == 2
    ratios = sorted(w["workers_samples_per_s"] / w["single_samples_per_s"] for w in windows)
    assert spread["low"] == pytest.approx(ratios[0]) and spread["high"] == pytest.approx(ratios[-1])
    assert result["speedup"] == pytest.approx((ratios[0] + ratios[1]) / 2)
    assert result["load"]["cpus"] >= 1 and "load average" in res.stdout


def test_no_orphans_when_the_launcher_is_killed(tmp_path: Path) -> None:
    """Neither the workers nor the children their scripts started outlive a SIGKILL."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "manygpu",
            "launch",
            "--nproc-per-node",
            "2",
            str(SCRIPTS / "spawns_child.py"),
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid*"))) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(1)
    proc.kill()  # SIGKILL: the launcher gets no chance to clean up
    proc.wait()
    assert_gone(tmp_path)  # workers asked the kernel to kill them with their parent
