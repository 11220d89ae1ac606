"""A worker's side of hang verdicts: say when it waits in a collective, and show itself on request.

Always on under ``manygpu launch``. torch's Flight Recorder (``TORCH_FR_BUFFER_SIZE``,
set by the launcher; it records gloo's collectives too, DDP's and FSDP's own
included) numbers every collective of a group. A daemon thread reads its
per-group counters twice a second (a few microseconds, no GIL held while the
main thread is in a collective) and writes ``progress-rank<R>.json`` when they
change: the collective this rank has been waiting in, and since when. The
launcher reads those files (:mod:`manygpu.launch.hangwatch`).

When the launcher asks (a ``request`` file), the same thread writes
``rank<R>.json``: every thread's Python stack, the pending and last records of
the Flight Recorder, and the process's children (a DataLoader's workers).
A rank whose threads cannot run (stopped, or in native code holding the GIL)
cannot answer; for that the launcher sends ``SIGUSR2``, on which
:mod:`faulthandler` writes every thread's stack from C into
``native-rank<R>.txt`` without needing the GIL.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from manygpu.runtime import env as envmod

POLL_S = 0.5
"""How often the thread looks at the counters and for a request."""
LAST_RECORDS = 8
"""Flight Recorder records kept in the evidence, besides the pending ones."""


def start(env: envmod.Environ) -> threading.Thread | None:
    """Start this worker's watcher (``None`` when not launched with an evidence directory)."""
    where = envmod.evidence_dir(env)
    rank = envmod.get_int(env, "RANK")
    if where is None or rank is None:
        return None
    out = Path(where)
    native = open(out / f"native-rank{rank}.txt", "w")  # noqa: SIM115 - lives as long as we do
    faulthandler.register(signal.SIGUSR2, file=native, all_threads=True, chain=False)
    # A fatal signal (gloo aborts on a size mismatch) leaves the stacks there too.
    faulthandler.enable(file=native, all_threads=True)
    world = envmod.get_int(env, "WORLD_SIZE") or 1
    attempt = envmod.restart_count(env)
    hello = {"rank": rank, "pid": os.getpid(), "world": world, "attempt": attempt}
    _write(out / f"hello-rank{rank}.json", hello)
    watcher = _Watcher(out, rank, attempt)
    thread = threading.Thread(target=watcher.run, name="manygpu-watch", daemon=True)
    thread.start()
    return thread


_FORMED = threading.Event()
"""Set once this worker is seen in a process group (a poll, or the end's own look)."""


def _in_group() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def note_if_alone(env: envmod.Environ) -> None:
    """At a clean end: leave ``alone-rank<R>`` if this worker never joined a process group.

    A script that never calls ``init_process_group`` (nor ``Parallel``) runs whole
    on every rank: N copies of one training, each writing the same files. The
    launcher says so once when every worker left this mark.
    """
    where, rank = envmod.evidence_dir(env), envmod.get_int(env, "RANK")
    if where is None or rank is None or _FORMED.is_set() or _ever_in_group():
        return
    with contextlib.suppress(OSError):
        (Path(where) / f"alone-rank{rank}").touch()


def _ever_in_group() -> bool:
    """Whether a process group existed in this process, even one destroyed since: the
    Flight Recorder keeps every group's configuration after ``destroy_process_group``."""
    if _in_group():
        return True
    if sys.modules.get("torch.distributed") is None:
        return False
    with contextlib.suppress(Exception):  # no recorder: judge by the polls alone
        return bool(fr_records().get("pg_config"))
    return False


def fr_status() -> dict[str, Any] | None:
    """The Flight Recorder's per-group counters, ``None`` before a group exists."""
    if not _in_group():
        return None
    _FORMED.set()
    from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]

    status: dict[str, Any] = json.loads(_dump_fr_trace_json(False, True)).get("pg_status", {})
    return status


def fr_records() -> dict[str, Any]:
    """Every record the Flight Recorder holds, and its counters (tens of ms: on request only)."""
    from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]

    dump: dict[str, Any] = json.loads(_dump_fr_trace_json(True, False))
    return dump


def pending(status: dict[str, Any]) -> tuple[str, int] | None:
    """(group id, sequence number) of the oldest collective enqueued but not completed."""
    waiting = []
    for pg, counters in status.items():
        done = int(counters.get("last_completed_collective", -1))
        queued = int(counters.get("last_enqueued_collective", -1))
        if queued > done:
            waiting.append((pg, max(done, 0) + 1))  # -1 before the first completes
    return min(waiting, key=lambda w: w[1]) if waiting else None


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


class _Watcher:
    def __init__(self, out: Path, rank: int, attempt: int) -> None:
        self.out, self.rank, self.attempt = out, rank, attempt
        self.waiting: tuple[str, int] | None = None
        self.since = 0.0
        self.published = False
        self.answered = ""

    def run(self) -> None:
        while True:
            try:
                self._progress()
                self._answer()
            except Exception:  # the watcher must never disturb the job
                pass
            time.sleep(POLL_S)

    def _progress(self) -> None:
        """Publish a collective this rank has waited in for a while (and when that ends).

        Only a wait seen on two polls in a row is written, with its timeout
        read once from its record: a training loop's collectives come and go
        between polls and cost nothing here.
        """
        status = fr_status()
        now = pending(status) if status is not None else None
        if now != self.waiting:
            if self.published:
                self._publish(None, None)
            self.waiting, self.since, self.published = now, time.time(), False
        elif now is not None and not self.published:
            self._publish(now, _timeout_s(now))

    def _publish(self, now: tuple[str, int] | None, timeout: float | None) -> None:
        doc: dict[str, Any] = {
            "rank": self.rank,
            "pid": os.getpid(),
            "attempt": self.attempt,
            "waiting": None,
        }
        if now is not None:
            doc["waiting"] = {"pg": now[0], "seq": now[1], "since": self.since}
            doc["timeout_s"] = timeout
        elif self.waiting is not None:  # the wait that just ended (a verdict may still read it)
            doc["waited"] = {"pg": self.waiting[0], "seq": self.waiting[1], "since": self.since}
        _write(self.out / f"progress-rank{self.rank}.json", doc)
        self.published = now is not None

    def _answer(self) -> None:
        request = self.out / "request"
        if not request.exists():
            return
        ask = request.read_text()
        if ask == self.answered:
            return
        _write(self.out / f"rank{self.rank}.json", self.evidence(ask))
        self.answered = ask

    def evidence(self, ask: str) -> dict[str, Any]:
        """What this rank is doing, for the verdict and the evidence file."""
        records: dict[str, Any] = {}
        if fr_status() is not None:
            dump = fr_records()
            entries = dump.get("entries", [])
            records = {"pg_status": dump.get("pg_status", {}), "entries": entries[-LAST_RECORDS:]}
        return {
            "request": ask,
            "rank": self.rank,
            "pid": os.getpid(),
            "time": time.time(),
            "threads": _threads(),
            "flight_recorder": records,
            "waiting": None
            if self.waiting is None
            else {"pg": self.waiting[0], "seq": self.waiting[1], "since": self.since},
        }


def _timeout_s(waiting: tuple[str, int]) -> float | None:
    """The pending collective's own timeout, from its record."""
    for entry in reversed(fr_records().get("entries", [])):
        group = entry.get("process_group", ["", ""])[0]
        if str(group) == waiting[0] and int(entry.get("collective_seq_id", -1)) == waiting[1]:
            return float(entry.get("timeout_ms", 0)) / 1000 or None
    return None


def _threads() -> list[dict[str, Any]]:
    """Every Python thread's stack, innermost last, without this watcher."""
    names = {t.ident: (t.name, t.daemon) for t in threading.enumerate()}
    me = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        name, daemon = names.get(ident, (f"thread {ident}", True))
        stack = [[f.filename, f.lineno, f.name] for f in traceback.extract_stack(frame)]
        out.append({"name": name, "daemon": daemon, "stack": stack})
    return out
