"""``HangWatch.stop`` returns once its thread has left the job's store (or gives up),
except while the watch judges a hang: it then ends the job itself, with a signal.

A daemon thread still inside a store call (native code that releases the GIL)
when the interpreter finalizes aborts the process as the call returns; the
launcher stops its watch before it returns, so that wait is what keeps its exit
clean. The store here is a fake whose ``check`` blocks until released.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from manygpu.launch import hangwatch


class _BlockingStore:
    """``check`` waits until ``release`` (a store call that takes its time)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.returned = threading.Event()

    def check(self, keys: list[str]) -> bool:
        self.entered.set()
        self.release.wait(10)
        self.returned.set()
        return False


class _AlarmStore(_BlockingStore):
    """Another host raised the alarm: ``check`` says so (once released)."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, str] = {}

    def check(self, keys: list[str]) -> bool:
        super().check(keys)
        return True

    def get(self, key: str) -> bytes:
        return b"ask"

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def add(self, key: str, amount: int) -> int:
        return amount

    def list_keys(self) -> list[str]:
        return []


def _watching(
    out: Path, store: _BlockingStore, ended: list[str] | None = None
) -> hangwatch.HangWatch:
    watch = hangwatch.HangWatch(
        out=out,
        host="h",
        default_timeout_s=60,
        job_store=lambda: (store, True, "p"),
        end_job=lambda: (ended if ended is not None else []).append("ended"),
        say=lambda line: None,
    ).start()
    assert store.entered.wait(5), "the watch never called the store"
    return watch


def test_stop_waits_for_the_store_call_to_return(tmp_path: Path) -> None:
    store = _BlockingStore()
    watch = _watching(tmp_path, store)
    releaser = threading.Timer(0.3, store.release.set)
    releaser.start()
    watch.stop()
    assert store.returned.is_set()
    assert not watch._thread.is_alive()
    releaser.join()


def test_stop_gives_up_on_a_store_call_that_does_not_return(tmp_path: Path) -> None:
    store = _BlockingStore()
    watch = _watching(tmp_path, store)
    start = time.monotonic()
    watch.stop(wait_s=0.3)
    waited = time.monotonic() - start
    assert 0.25 < waited < 3, waited
    assert not store.returned.is_set()
    store.release.set()
    watch._thread.join(5)


def test_stop_before_start_returns_at_once(tmp_path: Path) -> None:
    watch = hangwatch.HangWatch(out=tmp_path, host="h", default_timeout_s=60)
    watch.stop()


def test_a_watch_stopped_in_the_call_that_brings_the_alarm_judges_nothing(
    tmp_path: Path,
) -> None:
    store, ended = _AlarmStore(), list[str]()
    watch = _watching(tmp_path, store, ended)
    releaser = threading.Timer(0.3, store.release.set)
    releaser.start()
    watch.stop()
    assert not watch._thread.is_alive()
    assert watch.alarm_ns == 0 and watch.verdict is None and ended == []
    releaser.join()


def test_a_judging_watch_is_not_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It ends the job with a signal, which would interrupt the wait."""
    monkeypatch.setattr(hangwatch, "GATHER_S", 1.0)
    store, ended = _AlarmStore(), list[str]()
    store.release.set()
    watch = _watching(tmp_path, store, ended)
    deadline = time.monotonic() + 5
    while watch.alarm_ns == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watch.alarm_ns != 0
    start = time.monotonic()
    watch.stop()
    assert time.monotonic() - start < 0.5
    watch._thread.join(10)
    assert watch.verdict is not None and ended == ["ended"]
