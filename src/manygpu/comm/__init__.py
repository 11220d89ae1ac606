"""Collectives with timeouts and errors that name the rank and the operation."""

from manygpu.comm.collectives import all_gather, all_reduce, barrier, broadcast

__all__ = ["all_gather", "all_reduce", "barrier", "broadcast"]
