"""Which rank's failure caused the others: the first one in time that is not a consequence.

When one rank dies, its peers fail after it: they time out or lose their
connection in a collective, or the agent stops them with SIGTERM. Those are
consequences. torch's records only keep whole seconds and say nothing of
cause, so each worker also writes a small note when it ends abnormally (next
to torch's error file): when (nanoseconds), how (exception or exit code) and
whether the error was a peer's failure seen from here. A rank that leaves no
note (SIGKILL by the OOM killer, a segfault) is a root cause unless it was
stopped by the agent's SIGTERM.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from manygpu.runtime import env as envmod
from manygpu.runtime.ranks import ranks_text

NOTE_SUFFIX = ".manygpu.json"

# Words of errors that report another rank's failure (gloo, NCCL, c10d, ours).
_PEER_HINTS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "read error",
    "another rank never joined",
    "remote process exited",
    "socket timeout",
    "timed out",
)


# Marks of a backend's own error raised as a plain RuntimeError (gloo's source
# path, NCCL's words), so a user's RuntimeError with similar words is not one.
_BACKEND_MARKS = ("/gloo/", "nccl")

_PEER_ADDRESS = re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+|peer ([0-9.]+):\d+")


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` reports a peer's failure rather than this rank's own."""
    from manygpu.errors import CollectiveTimeoutError

    if isinstance(exc, CollectiveTimeoutError):
        return True
    text = str(exc).lower()
    from_backend = type(exc).__module__.startswith("torch") or (
        type(exc) is RuntimeError and any(m in text for m in _BACKEND_MARKS)
    )
    return from_backend and any(h in text for h in _PEER_HINTS)


_BACKEND_SOURCE = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h):\d+\]\s*")


def tidy(text: str) -> str:
    """A peer failure's recorded words without the backend's source location and advice
    ("RuntimeError: Read error [10.0.0.2]:41171: Connection reset by peer"), for the one
    line a consequence gets; the address stays (it names the lost host)."""
    short = _BACKEND_SOURCE.sub("", text)
    return short.split(". This is typically", 1)[0].split(" GLHF", 1)[0].rstrip(". ")


def peer_addresses(messages: list[str]) -> list[str]:
    """The peers' addresses that errors name ("Connection closed by peer [10.0.0.2]:41639",
    "Read error [10.0.0.2]:21173: Connection reset by peer"),
    in order of first mention: where the first failure happened, when no rank here has it."""
    seen: dict[str, None] = {}
    for text in messages:
        for match in _PEER_ADDRESS.finditer(text):
            seen.setdefault(match.group(1) or match.group(2), None)
    return list(seen)


def write(*, kind: str, code: int, consequence: bool) -> None:
    """Leave this worker's note next to its torch error file (if it has one)."""
    error_file = envmod.error_file(envmod.current())
    if not error_file:
        return
    note = {"time_ns": time.time_ns(), "kind": kind, "code": code, "consequence": consequence}
    try:
        os.makedirs(os.path.dirname(error_file) or ".", exist_ok=True)
        with open(error_file + NOTE_SUFFIX, "w") as fh:
            json.dump(note, fh)
    except OSError:
        pass  # a note is a help for the report, never a reason to fail


def reach_notes(failures: Mapping[int, Any], error_files: Mapping[int, str]) -> None:
    """Point each failure (torch's ``ProcessFailure``) back at the error file its worker
    was given (``error_files``, by local rank).

    torch replaces that path with "<N/A>" when the worker wrote no error (it exited
    with a code, or died by a signal), and the note beside it, which says when and
    how the worker ended or that its script had returned, was never read.
    """
    for failure in failures.values():
        given = error_files.get(failure.local_rank)
        if given and not os.path.isfile(failure.error_file):
            failure.error_file = given


def read(error_file: str) -> dict[str, Any] | None:
    """A worker's note, or ``None`` (it left none, or the file is unreadable)."""
    try:
        with open(error_file + NOTE_SUFFIX) as fh:
            note = json.load(fh)
    except (OSError, ValueError):
        return None
    return note if isinstance(note, dict) else None


@dataclass(frozen=True)
class Outcome:
    """How one rank (or, ``rank=-1``, a host's launcher) ended, as far as a launcher can tell.

    The one type for it: a node's agent makes them from torch's records and the
    workers' notes; under a launch over hosts each goes to the driver as one JSON
    line (:meth:`to_json`, :meth:`from_json`) with ``how`` already a whole report
    line, and the driver blames the first over every host with :func:`root_cause`.
    """

    rank: int
    exit_code: int
    """Shell convention: 128+N for a death by signal N."""
    time_ns: int
    consequence: bool
    how: str
    """Words for the report: "failed with exit code 3", "was killed by SIGKILL"; from a
    host, the whole line: "rank 3 failed with exit code 3: ValueError: boom"."""

    def to_json(self) -> str:
        """This outcome as one line of JSON."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Outcome | None:
        """The outcome ``text`` holds; ``None`` for anything else (never an exception)."""
        try:
            record = json.loads(text)
            return cls(
                rank=int(record["rank"]),
                exit_code=int(record["exit_code"]),
                time_ns=int(record["time_ns"]),
                consequence=bool(record["consequence"]),
                how=str(record["how"] if "how" in record else record["text"]),
            )
        except (ValueError, KeyError, TypeError):
            return None


RETURNED = "returned"
"""The note's kind when the script returned: what follows is the interpreter's shutdown."""
_AFTER_RETURN = " after its script had returned"
_NATIVE_AT_SHUTDOWN = (
    ": in the interpreter's shutdown, a daemon thread still in native code or a native destructor"
)


def outcome(rank: int, exitcode: int, timestamp_s: int, note: dict[str, Any] | None) -> Outcome:
    """One rank's end from torch's record (exit code, seconds) and our note.

    A rank whose note says its script returned, and that still failed, died in
    the interpreter's shutdown: its training is done, and the report says so
    (a daemon thread inside a store call when Python ends it aborts the process
    with "terminate called without an active exception").
    """
    returned = note is not None and note.get("kind") == RETURNED
    if note is not None and not returned and isinstance(note.get("time_ns"), int):
        code = int(note.get("code", 1))
        how = f"failed with exit code {code}"
        return Outcome(rank, code, note["time_ns"], bool(note.get("consequence")), how)
    if exitcode < 0:
        name = _signal_name(-exitcode)
        # SIGTERM is how the agent stops the survivors of a failure.
        stopped = -exitcode == signal.SIGTERM
        how = f"was killed by {name}" + (_after_return(-exitcode) if returned else "")
        return Outcome(rank, 128 - exitcode, timestamp_s * 10**9, stopped, how)
    how = f"failed with exit code {exitcode}" + (_AFTER_RETURN if returned else "")
    return Outcome(rank, exitcode, timestamp_s * 10**9, False, how)


def _after_return(signum: int) -> str:
    """What a death by ``signum`` after the script returned says: where an abort or a
    segfault in the shutdown comes from."""
    native = signum in (signal.SIGABRT, signal.SIGSEGV)
    return _AFTER_RETURN + (_NATIVE_AT_SHUTDOWN if native else "")


def hosts_file_names(address: str, hosts_text: str) -> list[str]:
    """The names ``/etc/hosts`` (``hosts_text``) gives ``address``: a lost peer named
    without a DNS query, which could hang the report of a job already failing."""
    for line in hosts_text.splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) > 1 and fields[0] == address:
            return fields[1:]
    return []


def lost_peers_line(
    ranks: list[int], texts: list[str], is_local: Callable[[str], bool], hosts_text: str
) -> str:
    """What a node says when all its ``ranks`` failed because of peers elsewhere: the
    addresses their errors (``texts``) name, with ``/etc/hosts`` names; never this
    host's own (``is_local``): a local rank that failed after the first, or, after a
    restart, an earlier run's ranks whose addresses the old rendezvous still held."""
    peers = []
    for address in peer_addresses(texts):
        if is_local(address):  # a local rank that failed after the first one
            continue
        names = hosts_file_names(address, hosts_text)
        peers.append(f"{address} ({names[0]})" if names else address)
    if not peers:
        return (
            f"the first failure was not here: {ranks_text(ranks)} of this node lost their "
            "connections to ranks elsewhere (another host's ranks or launcher ended, or the "
            "host went down; after a restart, possibly ranks of the job's earlier run); the "
            "other hosts' output says why"
        )
    return (
        f"the first failure was on the host(s) at {', '.join(peers)}, not here: "
        f"{ranks_text(ranks)} of this node lost their connections to it (its ranks or "
        "launcher ended, or the host went down); that host's own output says why"
    )


_RANK_TEXT = re.compile(r"^(?P<where>[^\n]*?: )?rank (?P<rank>\d+) (?P<rest>.*)$", re.S)
USAGE_PREFIX = "UsageError: "
"""How a worker's recorded error starts when it is a configuration error."""
_USAGE = re.compile(rf"^failed with exit code \d+: {USAGE_PREFIX}(?P<message>.*)$", re.S)
_INDENT = "  "


def report_lines(entries: list[tuple[str, Outcome]], *, lead: bool = True) -> list[str]:
    """The failure summary: the root cause first, ranks with the same words merged.

    ``entries`` pair each outcome with its line ("rank 1 failed with exit code 1:
    UsageError: ..."; a host's prefix allowed). The first line is the root cause
    and every rank that failed the same way on its own (a configuration error
    hits every rank alike: ``ranks 0, 1: unknown strategy ...``, without the
    exception's class); then ranks that failed otherwise on their own
    (``also``), then those that failed because of another (``then (a
    consequence)``), each group once, in order of time.
    """
    root = root_cause([o for _, o in entries])
    first = next(text for text, o in entries if o is root)
    head = _split(first)
    head = ("", *head[1:]) if _USAGE.match(head[2]) else head
    groups: dict[tuple[str, str, str], list[int]] = {}
    for text, o in sorted(entries, key=lambda e: (e[1] is not root, e[1].time_ns, e[1].rank)):
        where, rank, rest = _split(text)
        if _USAGE.match(rest):  # a configuration error is the same on every host
            where = ""
        same = (where, rest) == (head[0], head[2]) and not o.consequence
        kind = "" if lead and (o is root or same) else "then (a consequence) "
        kind = "also " if kind and lead and not o.consequence else kind
        groups.setdefault((kind, where, rest), []).append(rank)
    return [_render(kind, where, rest, ranks) for (kind, where, rest), ranks in groups.items()]


def _split(text: str) -> tuple[str, int, str]:
    match = _RANK_TEXT.match(text)
    if match is None:  # a host's launcher, not a rank: never merged
        return text, -1, ""
    return match["where"] or "", int(match["rank"]), match["rest"]


def _render(kind: str, where: str, rest: str, ranks: list[int]) -> str:
    indent = _INDENT + kind if kind else ""
    if ranks == [-1]:
        return f"{indent}{where}"
    usage = _USAGE.match(rest)
    if usage is not None and not kind:
        return f"{where}{ranks_text(ranks)}: {usage['message']}"
    if len(ranks) > 1 and rest.startswith("was "):
        rest = "were " + rest[4:]
    return f"{indent}{where}{ranks_text(ranks)} {rest}"


def restart_line(cause: str, attempt: int, restarts: int) -> str:
    """The one line before a restart: the rank that ended the attempt, how (``cause``:
    "rank 1 was killed by SIGKILL (pid 123)"), and which restart of how many this is."""
    return f"{cause}; restarting every worker (restart {attempt} of {restarts})"


def root_cause(outcomes: list[Outcome]) -> Outcome:
    """The first failure in time that is not a consequence (else the first of all)."""
    return min(outcomes, key=lambda o: (o.consequence, o.time_ns, o.rank))


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
