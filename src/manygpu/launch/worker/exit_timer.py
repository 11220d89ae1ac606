"""A finished worker exits, whatever its script left behind.

Once the user's script has returned (and its non-daemon threads are done), the
worker arms a timer. If the process is still alive when it fires, it is stuck in
interpreter shutdown: an atexit handler that never returns, or a destructor
deadlocked on the GIL (gloo's ``~ProcessGroupGloo`` joining a thread that waits
for the GIL holder). A Python-level watchdog cannot help there, since it needs
the GIL too; so the timer is a POSIX timer whose expiry makes a C thread call
``_exit(0)`` directly. The script's work is complete, so the exit status is 0.
``faulthandler`` first prints every thread's stack, so the user sees what hung.
"""

from __future__ import annotations

import ctypes
import faulthandler
import sys

_SIGEV_THREAD = 2
_CLOCK_MONOTONIC = 1


class _SigEvent(ctypes.Structure):
    """glibc's ``struct sigevent`` (64 bytes), for ``SIGEV_THREAD`` notification."""

    _fields_ = [
        ("value", ctypes.c_void_p),  # union sigval: the argument of the function
        ("signo", ctypes.c_int),
        ("notify", ctypes.c_int),
        ("function", ctypes.c_void_p),
        ("attributes", ctypes.c_void_p),
        ("_pad", ctypes.c_byte * 32),
    ]


class _TimeSpec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class _ITimerSpec(ctypes.Structure):
    _fields_ = [("interval", _TimeSpec), ("value", _TimeSpec)]


# Kept alive for the life of the process: the kernel timer refers to them.
_ARMED: list[object] = []


def arm(grace_s: float) -> bool:
    """End this process with status 0 in ``grace_s`` seconds unless it exits first.

    Returns whether the timer is armed (Linux with glibc or musl; elsewhere the
    worker simply exits as Python does).
    """
    if not sys.platform.startswith("linux") or grace_s <= 0:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        event = _SigEvent(value=None, signo=0, notify=_SIGEV_THREAD)
        event.function = ctypes.cast(libc._exit, ctypes.c_void_p).value
        timer = ctypes.c_void_p()
        if libc.timer_create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
            return False
        whole = int(grace_s)
        when = _ITimerSpec(value=_TimeSpec(whole, int((grace_s - whole) * 1e9)))
        if libc.timer_settime(timer, 0, ctypes.byref(when), None) != 0:
            return False
    except (OSError, AttributeError):
        return False
    _ARMED.extend([libc, event, timer, when])
    # Just before the end: every thread's stack, so the hang can be fixed.
    faulthandler.dump_traceback_later(max(grace_s - 0.5, 0.1), exit=False, file=2)
    return True
