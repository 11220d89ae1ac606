"""Collectives with timeouts and errors that name the rank and the operation.

``debug=True`` (or ``MANYGPU_DEBUG=1``) checks that every rank calls the same
operation on the same shape and dtype before calling it.
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
from manygpu.comm.objects import all_gather_object, broadcast_object
from manygpu.comm.p2p import exchange, recv, send

__all__ = [
    "CollectiveMismatchError",
    "ReduceOp",
    "all_gather",
    "all_gather_object",
    "all_gather_uneven",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object",
    "exchange",
    "recv",
    "reduce",
    "reduce_scatter",
    "send",
]
