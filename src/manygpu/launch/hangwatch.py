"""A launcher's side of hang verdicts: notice a rank stuck past its timeout, gather, judge.

Each host's launcher watches its own workers' files (:mod:`manygpu.launch.evidence`).
When one of them has waited in a collective for nearly that collective's own
timeout, the launcher raises the alarm (in the job's store, for the other
hosts), asks each of its workers what it is doing, looks from outside at those
that cannot answer (stopped, exited, silent in native code: ``/proc`` and
faulthandler's ``SIGUSR2`` dump), and sends one message per host. The host
that serves the rendezvous store gathers those, asks again any rank whose
open collective the others have already finished (:func:`verdict.behind`: its
answer was read before its recorder counted that end), prints the verdict
(:mod:`manygpu.launch.verdict`) and the evidence directory, and every
launcher then stops its workers. The alarm goes off a little before the
backend's own timeout, so every rank is still there to be asked.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from manygpu.launch import verdict
from manygpu.launch.verdict import Collective, RankView
from manygpu.runtime import env as envmod

ANSWER_S = 2.0
"""How long workers get to answer before they are looked at from outside."""
GATHER_S = 6.0
"""How long the gathering host waits for the other hosts' messages."""
POLL_S = 0.5
STOP_WAIT_S = 5.0
RECHECK_WAIT_S = 1.0
"""How long a rank whose answer looks stale (:func:`verdict.behind`) is left before it is
asked again: two polls of its watcher (``evidence.POLL_S``), so the new answer comes from
its Flight Recorder's counters read anew."""
RECHECKS = 2
"""How many times such a rank is asked again before it is judged on what it last said."""
RECHECK_MARGIN_S = 1.0
"""Left, after a last question, for the verdict to be written and sent before the earliest
waiting rank's own timeout ends it (and its evidence)."""
"""How long :meth:`HangWatch.stop` waits for the watch's thread to leave a store call."""


def alarm_after(timeout_s: float) -> float:
    """Seconds of waiting that raise the alarm: before the collective's own timeout ends
    the waiting ranks, leaving time to ask every rank (15 s, or half of a short timeout)."""
    return max(timeout_s * 0.5, timeout_s - 15.0)


class HangWatch:
    """One launcher's watch over its workers' waits (a daemon thread).

    Args:
        out: this host's evidence directory (the workers' ``MANYGPU_EVIDENCE_DIR``).
        host: how this host is named in a verdict.
        default_timeout_s: for a wait whose collective's timeout is not recorded.
        job_store: once the rendezvous is done, for a job over several hosts: its
            store, whether this host gathers the others' messages and judges, and
            the prefix of this job's keys (``None``: one host, or not yet).
        end_job: called once the verdict is out (stops this host's workers).
    """

    def __init__(
        self,
        *,
        out: Path,
        host: str,
        default_timeout_s: float,
        job_store: Callable[[], tuple[Any, bool, str] | None] = lambda: None,
        end_job: Callable[[], None] | None = None,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.out, self.host, self.default_timeout_s = out, host, default_timeout_s
        self.job_store = job_store
        self.store: Any = None
        self.gathers, self.prefix = True, "manygpu.hang"
        self.end_job = end_job or (lambda: os.kill(os.getpid(), signal.SIGTERM))
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.verdict: tuple[str, int] | None = None
        self.alarm_ns = 0
        """When the alarm went off here (the verdict's time in a report)."""
        self._store_lost = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="manygpu-hangwatch", daemon=True)

    def start(self) -> HangWatch:
        self._thread.start()
        return self

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """Stop the watch; return once its thread has ended, or after ``wait_s``.

        The thread calls the job's store, native code that releases the GIL. A
        daemon thread that returns from such a call while the interpreter
        finalizes is ended by Python with ``pthread_exit``, whose unwinding
        through pybind11's GIL guard (a ``noexcept`` destructor) calls
        ``std::terminate``: the launcher aborted at its exit (SIGABRT,
        "terminate called without an active exception") after a good job. A
        store call takes milliseconds; one that takes longer than ``wait_s``
        has lost its store and returns only at the store's timeout, long after
        this process has exited.

        A watch that has raised the alarm is not waited for: it is judging, and
        ends the job with a signal (``end_job``), which would interrupt the wait.
        """
        with self._lock:
            self._stop.set()
            judging = self.alarm_ns != 0
        alive = self._thread.is_alive() and self._thread is not threading.current_thread()
        if alive and not judging:
            self._thread.join(wait_s)

    # -- noticing ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                alarm = self._alarm()
            except Exception:  # a watch that fails must not end a healthy job
                self._forget_store()
                continue
            if alarm is not None:
                with self._lock:
                    if self._stop.is_set():  # the job has ended: nothing to judge
                        return
                    self.alarm_ns = time.time_ns()
                try:
                    self._judge(alarm)
                except Exception as exc:  # the store's host ended first, or worse
                    if self.verdict is None:
                        self.verdict = (f"no verdict here ({type(exc).__name__})", -1)
                    self.end_job()
                return

    def _alarm(self) -> str | None:
        """The alarm's id once raised, here (a local wait too long) or by another host."""
        if self.store is None and not self._store_lost and (found := self.job_store()):
            self.store, self.gathers, self.prefix = found
        if self.store is not None and self.store.check([self._key("alarm")]):
            return str(self.store.get(self._key("alarm")).decode())
        now = time.time()
        for doc in _read_all(self.out, "progress-rank"):
            waiting = doc.get("waiting")
            if not waiting:
                continue
            limit = doc.get("timeout_s") or self.default_timeout_s
            if now - float(waiting["since"]) >= alarm_after(float(limit)):
                return self._raise_alarm()
        return None

    def _forget_store(self) -> None:
        """After the job's store failed (its host has ended: the job is ending), leave it.

        Asking it again every poll would fail again, and each failure prints a
        native stack trace on this host's stderr.
        """
        if self.store is not None:
            self.store, self._store_lost = None, True

    def _raise_alarm(self) -> str:
        ask = uuid.uuid4().hex
        if self.store is None:
            return ask
        won = self.store.compare_set(self._key("alarm"), "", ask)
        return str(won.decode())

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    # -- gathering and judging ----------------------------------------------------------

    def _judge(self, ask: str) -> None:
        views = self.local_views(ask)
        if self.store is None:
            self._conclude(self._recheck(views))
            return
        self.store.set(self._key(f"host/{self.host}"), json.dumps([asdict(v) for v in views]))
        self.store.add(self._key("hosts"), 1)
        if self.gathers:
            self._conclude(self._recheck(self._gather()))
        else:
            self._await_verdict()

    def _recheck(self, views: list[RankView]) -> list[RankView]:
        """``views`` with the ranks whose answer looks stale asked again, a bounded number of
        times and only while the waiting ranks' own timeout leaves room for it."""
        for round_ in range(1, RECHECKS + 1):
            stale = verdict.behind(views)
            if not stale or self._time_left() < RECHECK_WAIT_S + ANSWER_S + RECHECK_MARGIN_S:
                break
            time.sleep(RECHECK_WAIT_S)
            fresh = self._ask_again(stale, round_, {v.rank: v.host for v in views})
            views = [fresh.get(v.rank, v) for v in views]
        return views

    def _time_left(self) -> float:
        """Seconds until the first of this host's waiting ranks reaches its collective's
        timeout (then its backend ends the wait, and the job); a long time when none waits."""
        ends = [
            float(doc["waiting"]["since"]) + float(doc.get("timeout_s") or self.default_timeout_s)
            for doc in _read_all(self.out, "progress-rank")
            if doc.get("waiting")
        ]
        return min(ends) - time.time() if ends else float(RECHECKS * 3600)

    def _ask_again(
        self, ranks: list[int], round_: int, hosts: dict[int, str]
    ) -> dict[int, RankView]:
        """New views of ``ranks``, those that answered: this host's directly, the other
        hosts' through the store (``reask/<round>``, answered in ``reanswer/<round>/<host>``)."""
        ask = uuid.uuid4().hex
        mine = set(self._hello())
        remote = [r for r in ranks if r not in mine]
        if remote and self.store is not None:
            self.store.set(self._key(f"reask/{round_}"), json.dumps({"ask": ask, "ranks": remote}))
        fresh = {v.rank: v for v in self._answers(ask, [r for r in ranks if r in mine])}
        waiting_for = {hosts[r] for r in remote if r in hosts} - {self.host}
        deadline = time.monotonic() + ANSWER_S + 1.0
        while waiting_for and self.store is not None and time.monotonic() < deadline:
            for host in list(waiting_for):
                key = self._key(f"reanswer/{round_}/{host}")
                if self.store.check([key]):
                    fresh.update(
                        (raw["rank"], _view(raw)) for raw in json.loads(self.store.get(key))
                    )
                    waiting_for.discard(host)
            time.sleep(0.1)
        return fresh

    def _answer_again(self, answered: set[int]) -> bool:
        """Answer a ``reask/<round>`` of the gathering host not ``answered`` yet, if one is
        there, for this host's ranks (a round that asked only the gatherer's own ranks
        never appears, so every round is looked for)."""
        for round_ in range(1, RECHECKS + 1):
            key = self._key(f"reask/{round_}")
            if round_ in answered or not self.store.check([key]):
                continue
            doc = json.loads(self.store.get(key))
            mine = [r for r in doc["ranks"] if r in self._hello()]
            views = self._answers(str(doc["ask"]), mine)
            answer = json.dumps([asdict(v) for v in views])
            self.store.set(self._key(f"reanswer/{round_}/{self.host}"), answer)
            answered.add(round_)
            return True
        return False

    def _gather(self) -> list[RankView]:
        """Every host's views, until they cover the world or the wait is over."""
        deadline = time.monotonic() + GATHER_S
        views: dict[int, RankView] = {}
        world = self._world()
        while True:
            for key in self.store.list_keys():
                if key.startswith(self._key("host/")):
                    for raw in json.loads(self.store.get(key)):
                        views[raw["rank"]] = _view(raw)
            if len(views) >= world or time.monotonic() > deadline:
                return list(views.values())
            time.sleep(0.2)

    def _conclude(self, views: list[RankView]) -> None:
        world = max(self._world(), max((v.rank for v in views), default=-1) + 1)
        line, rank = verdict.compose(views, world)
        self.verdict = (line, rank)
        record = {"verdict": line, "rank": rank, "ranks": [asdict(v) for v in views]}
        (self.out / "verdict.json").write_text(json.dumps(record, indent=1))
        self.say(f"manygpu: hang: {line}")
        self.say(f"manygpu: evidence (stacks and collective records per rank): {self.out}")
        if self.store is not None:
            self.store.set(self._key("verdict"), json.dumps({"line": line, "rank": rank}))
        self.end_job()

    def _await_verdict(self) -> None:
        # The gathering host's wait, then its questions again, each at most: the pause,
        # its own ranks' answers, then ours.
        rechecks = RECHECKS * (RECHECK_WAIT_S + 2 * ANSWER_S + 1.0)
        deadline = time.monotonic() + GATHER_S + 10 + rechecks
        self.verdict = ("the verdict is printed by the host that serves the store", -1)
        try:
            answered: set[int] = set()
            while time.monotonic() < deadline:
                if self.store.check([self._key("verdict")]):
                    doc = json.loads(self.store.get(self._key("verdict")))
                    self.verdict = (doc["line"], int(doc["rank"]))
                    break
                if not self._answer_again(answered):
                    time.sleep(0.2)
        finally:  # the store's host may end (and its store go) before we read it
            self.end_job()

    def _world(self) -> int:
        return max((int(d.get("world", 1)) for d in _read_all(self.out, "hello-rank")), default=1)

    # -- this host's ranks ----------------------------------------------------------------

    def local_views(self, ask: str) -> list[RankView]:
        """What each of this host's ranks is doing: its answer, else what shows from outside."""
        hello = self._hello()
        answers = self._ask(ask, set(hello))
        views = []
        for rank, pid in sorted(hello.items()):
            answer = answers.get(rank)
            views.append(self._answered(answer, pid) if answer else self._outside(rank, pid))
        return views

    def _answers(self, ask: str, ranks: list[int]) -> list[RankView]:
        """The views of those of ``ranks`` (this host's) that answer ``ask`` in time."""
        hello = self._hello()
        if not set(ranks) & set(hello):  # nothing to ask here: no request
            return []
        answers = self._ask(ask, set(ranks) & set(hello))
        return [self._answered(doc, hello[rank]) for rank, doc in sorted(answers.items())]

    def _hello(self) -> dict[int, int]:
        """This host's ranks (of the current attempt) and their pids."""
        return {int(d["rank"]): int(d["pid"]) for d in _read_all(self.out, "hello-rank")}

    def _ask(self, ask: str, ranks: set[int]) -> dict[int, dict[str, Any]]:
        """Ask this host's workers (the request file every watcher reads) and collect the
        answers of ``ranks`` until all came or :data:`ANSWER_S` is over."""
        (self.out / "request").write_text(ask)
        deadline = time.monotonic() + ANSWER_S
        answers: dict[int, dict[str, Any]] = {}
        while time.monotonic() < deadline and len(answers) < len(ranks):
            for doc in _read_all(self.out, "rank"):
                if doc.get("request") == ask and int(doc["rank"]) in ranks:
                    answers[int(doc["rank"])] = doc
            time.sleep(0.1)
        return answers

    def _answered(self, doc: dict[str, Any], pid: int) -> RankView:
        rank = int(doc["rank"])
        main = _main_stack(doc.get("threads", []))
        detail = ""
        if verdict.in_dataloader(main):
            detail = "in the DataLoader" + _loader_detail(self.out, rank, pid)
        waiting = _collective(doc)
        return RankView(
            rank=rank,
            host=self.host,
            state="answered",
            waiting=waiting,
            where=verdict.own_frame(main),
            detail=detail,
            evidence=str(self.out / f"rank{rank}.json"),
            extra={verdict.DEBUG_CHECK: "1"} if verdict.in_debug_check(main) else {},
        )

    def _outside(self, rank: int, pid: int) -> RankView:
        state = _proc_state(pid)
        native = self.out / f"native-rank{rank}.txt"
        if state is None:
            return RankView(rank=rank, host=self.host, state="exited", detail="its process is gone")
        where = ""
        if state != "T":
            where = _native_frame(native, pid)
        return RankView(
            rank=rank,
            host=self.host,
            state="stopped" if state == "T" else "silent",
            where=where,
            evidence=str(native),
        )


def _read_all(out: Path, stem: str) -> list[dict[str, Any]]:
    """Every ``<stem><rank>.json`` of the workers' current attempt.

    After an elastic restart a smaller world leaves the earlier attempt's files
    of the ranks that are gone: a wait one of them published must not raise an
    alarm in the new attempt, nor its rank count in the world.
    """
    docs = []
    for path in out.glob(f"{stem}*.json"):
        if not path.name[len(stem) :].removesuffix(".json").isdigit():
            continue
        try:
            docs.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    latest = _current_attempt(out)
    return [d for d in docs if int(d.get("attempt", 0)) == latest or stem == "rank"]


def _current_attempt(out: Path) -> int:
    attempts = [0]
    for path in out.glob("hello-rank*.json"):
        try:
            attempts.append(int(json.loads(path.read_text()).get("attempt", 0)))
        except (OSError, ValueError):
            continue
    return max(attempts)


def _view(raw: dict[str, Any]) -> RankView:
    waiting = raw.get("waiting")
    return RankView(**{**raw, "waiting": Collective(**waiting) if waiting else None})


def _main_stack(threads: list[dict[str, Any]]) -> list[list[object]]:
    for thread in threads:
        if thread.get("name") == "MainThread":
            return list(thread.get("stack", []))
    return list(threads[0].get("stack", [])) if threads else []


def _collective(doc: dict[str, Any]) -> Collective | None:
    """The collective a rank waits in, named from its Flight Recorder record."""
    waiting = doc.get("waiting")
    if not waiting:
        return None
    pg, seq = str(waiting["pg"]), int(waiting["seq"])
    for entry in doc.get("flight_recorder", {}).get("entries", []):
        group = str(entry.get("process_group", [""])[0])
        if group == pg and int(entry.get("collective_seq_id", -1)) == seq:
            op = str(entry.get("profiling_name", "")).split(":")[-1]
            return Collective(pg=pg, seq=seq, op=op, args=_args(entry))
    return Collective(pg=pg, seq=seq)


_DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
}


def _args(entry: dict[str, Any]) -> str:
    """``float32[1024]`` from a record's input dtypes and sizes."""
    dtypes = [_DTYPES.get(str(d), str(d)) for d in entry.get("input_dtypes", [])]
    sizes = entry.get("input_sizes", [])
    return ", ".join(f"{d}[{','.join(map(str, s))}]" for d, s in zip(dtypes, sizes, strict=False))


def _proc_state(pid: int) -> str | None:
    """``/proc``'s one-letter state (``T``: stopped), ``None`` when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            text = fh.read()
    except OSError:
        return None
    state = text.rpartition(")")[2].split()[0]
    return None if state in ("Z", "X") else state


def _native_frame(native: Path, pid: int, *, own_only: bool = False) -> str:
    """faulthandler's view of the main thread (works while another thread holds the GIL)."""
    before = native.stat().st_size if native.exists() else 0
    try:
        os.kill(pid, signal.SIGUSR2)
    except OSError:
        return ""
    time.sleep(0.5)
    try:
        with open(native) as fh:
            fh.seek(before)
            stacks = verdict.parse_faulthandler(fh.read())
    except OSError:
        return ""
    return verdict.own_frame(stacks[-1], own_only=own_only) if stacks else ""


def _loader_detail(out: Path, rank: int, pid: int) -> str:
    """Which DataLoader worker the rank waits for, and where it is (forked workers inherit
    the rank's faulthandler registration, so each can be asked the same way)."""
    import psutil

    try:
        children = psutil.Process(pid).children()
    except psutil.Error:
        return ""
    native = out / f"native-rank{rank}.txt"
    for index, child in enumerate(children):
        where = _native_frame(native, child.pid, own_only=True)
        if where:
            return f" (worker {index} at {where})"
    return f" ({len(children)} workers, none in your code)" if children else ""


FATAL = frozenset({signal.SIGABRT, signal.SIGSEGV, signal.SIGFPE, signal.SIGBUS, signal.SIGILL})
"""Signals on which faulthandler writes a dying worker's stacks (gloo aborts with SIGABRT)."""


def crash_site(rank: int, signum: int) -> str:
    """Where this node's rank ``rank`` was when ``signum`` killed it ("" when unknown)."""
    where = envmod.evidence_dir(envmod.current())
    if signum not in FATAL or not where:
        return ""
    try:
        text = (Path(where) / f"native-rank{rank}.txt").read_text()
    except OSError:
        return ""
    dump = text.rpartition("Fatal Python error")[2]
    stacks = verdict.parse_faulthandler(dump) if dump != text else []
    return verdict.own_frame(stacks[-1]) if stacks else ""  # the main thread is listed last
