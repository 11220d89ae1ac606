"""Host memory a sharded job gives back: glibc's allocator settings and ``malloc_trim``.

A correct sharding frees each whole block once its shard is kept, and FSDP2
frees every all-gathered block after its forward and backward. glibc's malloc
raises its mmap threshold the first time a large mmapped buffer is freed (up
to 32 MiB on 64-bit), so from then on the 4-16 MiB weights and gradients of a
typical block come from the heap arenas, and a freed arena chunk stays in the
process's resident set. Measured on a 1 GB GPT under FSDP2 at 4 CPU ranks
(``bench/prepare_memory.py``, meta build, shard, ``to_empty``, one SGD step):
each rank's peak was 1.34x the model with glibc's defaults and 0.80x with a
fixed threshold, and its resident set after the step 1.10x against 0.56x
(params + grads are 0.5x).

A fixed ``MALLOC_MMAP_THRESHOLD_`` turns that adjustment off, so every
allocation above it is its own mapping, returned to the kernel on ``free``.
``manygpu launch`` sets it for its workers (:func:`malloc_defaults`) unless the
user chose any allocator setting of their own (theirs win, untouched).
:func:`release_host_memory` is the in-process complement for jobs started
otherwise: ``malloc_trim(0)`` after a phase that freed a lot (materializing,
loading weights).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Mapping

MMAP_THRESHOLD_BYTES = 1 << 20
"""Allocations of 1 MiB and up are mmapped and go back to the kernel when freed.

glibc's own start value is 128 KiB (it then grows with what is freed); a fixed
128 KiB gave the same peak here (0.80x vs 0.84x at 1 MiB), but maps and unmaps
every mid-sized activation of a CPU training step. At 1 MiB the buffers that
matter (a block's weights and gradients, megabytes each) are still mapped,
while the many small ones keep coming from the arenas."""

MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_",)
"""What :func:`malloc_defaults` sets: only the threshold (setting it also turns
off glibc's dynamic threshold, the cause of the retention)."""


def malloc_defaults(env: Mapping[str, str], user_set: bool) -> dict[str, str]:
    """The glibc settings ``manygpu launch`` adds to its workers' environment.

    Empty when ``user_set`` (the user set a ``MALLOC_*`` variable or a malloc
    tunable: their choice stands whole, not merged with ours) or when ``env``
    already holds ours.
    """
    if user_set or any(name in env for name in MALLOC_VARIABLES):
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES)}


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
    """In this process, what :func:`malloc_defaults` does for launched workers.

    For jobs started by another launcher (torchrun, ``srun`` directly): the
    threshold then applies from this call on, so call it before the model is
    built. Nothing when ``user_set`` (their settings stand) or without glibc's
    ``mallopt``. Returns whether the threshold was set.
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
