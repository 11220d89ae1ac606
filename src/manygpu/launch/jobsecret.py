"""The job's secret: what a node must hold to join a job that meets over the network.

A multi-node job's rendezvous store has to listen where the other hosts reach
it, and so does any stranger on that network. The store itself sits behind a
:class:`~manygpu.runtime.store_gate.Gate` keyed by this secret; the run id
(and so every rendezvous key) is derived from it too, so a leftover launcher
of another job with another secret cannot meet this one.

Where it comes from, first found wins: the driver of ``-H`` / ``--hostfile``
draws a fresh one and hands it to every host on the ssh stdin pipe;
``--job-secret-file FILE``; ``MANYGPU_JOB_SECRET``. It is never on a command
line and never in the store, and the launcher removes it from the environment
its workers inherit.
"""

from __future__ import annotations

from manygpu.errors import UsageError
from manygpu.runtime.secret import JobSecret, is_loopback, load

__all__ = ["HOW", "JobSecret", "is_loopback", "load", "refusal", "required"]

HOW = (
    "put the same secret on every node: export MANYGPU_JOB_SECRET=$(openssl rand -hex 32) "
    "(or --job-secret-file FILE, mode 600); -H/--hostfile draws one for you"
)


def required(endpoint_host: str) -> bool:
    """Whether a job must have a secret: its store listens beyond loopback.

    A job that meets on loopback (one node, or several launchers on one
    machine) is reachable from this machine only, as a one-node job always
    is. A job whose rendezvous address is a network address can be reached
    by other hosts, and so by strangers.
    """
    return not is_loopback(endpoint_host)


def refusal(endpoint: str) -> UsageError:
    """The one line for a network job without a secret."""
    return UsageError(
        f"this job meets over the network (rendezvous {endpoint}), so its nodes must prove "
        f"they belong to it: {HOW}"
    )
