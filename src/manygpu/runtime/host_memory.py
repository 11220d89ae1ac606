"""Host memory a sharded job gives back: glibc's mmap threshold and ``malloc_trim``.

A correct sharding frees each whole block once its shard is kept, and FSDP2
frees every all-gathered block after its forward and backward. glibc's malloc
raises its mmap threshold the first time a large mmapped buffer is freed (up
to 32 MiB on 64-bit), so from then on the 1-16 MiB weights and gradients of a
typical block come from the heap arenas, and a freed arena chunk stays in the
process's resident set. Measured on a 1 GB GPT under FSDP2 at 4 CPU ranks
(``bench/prepare_memory.py``, meta build, shard, ``to_empty``, one SGD step):
each rank's peak was 1.34x the model with glibc's defaults and 0.84x with a
fixed 1 MiB threshold, its resident set after the step 1.10x against 0.61x
(params + grads are 0.5x).

A fixed threshold is not free: every allocation above it is its own mapping,
faulted in and unmapped each time, which cost a small CPU training loop 20-50%
more CPU time per step. So it is for jobs whose strategy splits the weights,
set in the process when the strategy is known and before the model is built
(:func:`fix_mmap_threshold`), never by the launcher for every job; a user who
set any ``MALLOC_*`` variable or ``glibc.malloc.*`` tunable keeps theirs.
:func:`release_host_memory` (``malloc_trim(0)``) hands back what a one-time
phase freed (a model built whole then sharded, weights read into shards).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

MMAP_THRESHOLD_BYTES = 1 << 20
"""Allocations of 1 MiB and up are mmapped and go back to the kernel when freed.

It must stay at or below a block's weight matrices: at 4 MiB (the 1024-wide
model's q/k/v size) the peak was 0.85x, at 8 MiB 1.22x, at 32 MiB (glibc's
dynamic ceiling) 1.54x. glibc's own start value, 128 KiB, gave 0.80x but
maps and unmaps more of the small buffers of every step."""

M_MMAP_THRESHOLD = -3
"""``mallopt``'s parameter number for the mmap threshold (glibc's malloc.h)."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, or ``None`` where it cannot be opened."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else ctypes.CDLL(None)
    except OSError:
        return None


def fix_mmap_threshold(user_set: bool) -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES` in this process.

    For a job whose strategy splits the weights, called before the model is
    built (it applies from this call on, whatever launched the process).
    Nothing when ``user_set`` (their ``MALLOC_*`` / tunables stand) or without
    glibc's ``mallopt``. Returns whether the threshold was set.
    """
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if user_set or mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """glibc's ``malloc_trim``, or ``None`` where the C library has none (musl, macOS)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_host_memory() -> bool:
    """Hand the heap's free pages back to the kernel (``malloc_trim(0)``).

    Call it after a phase that freed much more than it keeps (a model built
    whole then sharded, weights read then copied into shards). It costs a walk
    over the arenas' free lists (milliseconds), so it is not for every step.
    Returns whether memory was released; ``False`` without glibc (no error).
    """
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
