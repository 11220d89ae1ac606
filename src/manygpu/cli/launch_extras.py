"""Flags users bring from ``accelerate launch`` and ``horovodrun`` to ``manygpu launch``.

- ``--strategy`` / ``--precision``: defaults for a ``Parallel()`` that names none
  (the code's own argument wins, then the launcher's flag, then the default). They
  reach the workers as ``MANYGPU_STRATEGY`` / ``MANYGPU_PRECISION``, in the
  environment, which a launch over hosts forwards without a command line.
- ``--network-interface IFACE``: the interface gloo and NCCL use
  (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``).
- ``--output-filename DIR``: every worker's output also in per-rank files under
  ``DIR`` (horovodrun's flag): ``--log-dir DIR --tee 3``.
"""

from __future__ import annotations

import argparse
from typing import Any

from manygpu.errors import UsageError


def add_extras(p: argparse.ArgumentParser) -> None:
    """The flags above, on ``manygpu launch``'s parser."""
    p.add_argument(
        "--strategy",
        dest="default_strategy",
        help="strategy for a Parallel() that names none (the code's own argument wins)",
    )
    p.add_argument(
        "--precision",
        dest="default_precision",
        help="precision for a Parallel() that names none (the code's own argument wins)",
    )
    p.add_argument(
        "--network-interface",
        metavar="IFACE",
        help="network interface for gloo and NCCL (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)",
    )
    p.add_argument(
        "--output-filename",
        metavar="DIR",
        help="also write each worker's output to per-rank files under DIR (horovodrun's flag)",
    )


def apply_extras(ns: argparse.Namespace, *, local: bool) -> dict[str, str]:
    """Check the flags, fold ``--output-filename`` into ``ns``; the workers' variables.

    ``local``: the job runs on this machine only, so an interface can be checked here.
    """
    env: dict[str, str] = {}
    if ns.default_strategy is not None:
        env["MANYGPU_STRATEGY"] = _strategy(ns.default_strategy)
    if ns.default_precision is not None:
        env["MANYGPU_PRECISION"] = _precision(ns.default_precision)
    if ns.network_interface is not None:
        _interface(ns.network_interface, local)
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = ns.network_interface
    if ns.output_filename is not None:
        if ns.log_dir not in (None, ns.output_filename):
            raise UsageError("--output-filename and --log-dir both name the logs' folder; give one")
        ns.log_dir = ns.output_filename
        if ns.tee is None and ns.redirects is None:
            ns.tee = "3"
    return env


def _strategy(name: str) -> str:
    from manygpu.strategies.registry import RULES, available, unknown_name

    if name not in (*available(), *RULES):
        raise UsageError(f"--strategy: {unknown_name(name)}")
    return name


def _precision(name: str) -> str:
    from manygpu.core.config import PRECISIONS

    if name not in PRECISIONS:
        raise UsageError(f"--precision {name!r}: choose one of {', '.join(PRECISIONS)}")
    return name


def _interface(name: str, local: bool) -> None:
    if not local:
        return  # another host's interfaces are that host's to know
    import psutil

    names: dict[str, Any] = psutil.net_if_addrs()
    if name not in names:
        raise UsageError(
            f"--network-interface {name!r}: no such interface here; this machine has "
            f"{', '.join(sorted(names))}"
        )
