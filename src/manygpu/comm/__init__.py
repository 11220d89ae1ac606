"""Collectives with timeouts and errors that name the rank and the operation.

``debug=True`` (or ``MANYGPU_DEBUG=1``) checks that every rank calls the same
operation on the same shape and dtype before calling it; ``MANYGPU_DEBUG=strict``
compares the call sites too (:mod:`manygpu.comm.debug`). The ``*_json`` object
collectives carry manygpu's own metadata; the ``*_object`` ones pickle.
"""

from manygpu.comm.collectives import (
    ReduceOp,
    all_gather,
    all_gather_uneven,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    reduce,
    reduce_scatter,
)
from manygpu.comm.debug import CollectiveMismatchError
from manygpu.comm.objects import (
    PayloadError,
    all_gather_json,
    all_gather_object,
    broadcast_json,
    broadcast_object,
)
from manygpu.comm.p2p import exchange, recv, send

__all__ = [
    "CollectiveMismatchError",
    "PayloadError",
    "ReduceOp",
    "all_gather",
    "all_gather_json",
    "all_gather_object",
    "all_gather_uneven",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_json",
    "broadcast_object",
    "exchange",
    "recv",
    "reduce",
    "reduce_scatter",
    "send",
]
