"""``--log-with`` and ``--run-dir`` for the commands that train (``demo``, ``bench train``).

The names are checked while the command line is parsed (argparse's ``type``),
so a typo is one line and exit code 2 before any worker starts; a tracker whose
optional extra is missing is one line too, from :func:`chosen`, still before
the launch. Only the registry is imported here, which names trackers without
importing them (building the parser stays cheap).
"""

from __future__ import annotations

import argparse

from manygpu.errors import UsageError

KNOWN = "tensorboard, mlflow, wandb, jsonl"
"""The tracker names, for help texts (the registry is the authority)."""


def tracker_names(text: str) -> tuple[str, ...]:
    """argparse type: ``"tensorboard,jsonl"`` -> the names, each checked against the registry."""
    from manygpu.tracking.registry import check_names

    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no tracker; give one of {KNOWN}")
    try:
        return check_names(names)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_tracking_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--log-with`` (repeatable, or a comma list) and ``--run-dir``."""
    parser.add_argument(
        "--log-with",
        action="append",
        type=tracker_names,
        metavar="NAME[,NAME]",
        help=f"log every step to these trackers (repeat, or a comma list): {KNOWN}",
    )
    parser.add_argument(
        "--run-dir",
        metavar="DIR",
        help="where the trackers write, one folder per run (default: runs)",
    )


def chosen(ns: argparse.Namespace) -> tuple[tuple[str, ...], str | None]:
    """The trackers asked for (each once, in order) and the run directory.

    Raises:
        UsageError: a tracker's optional extra is not installed (the line names
            the ``pip install`` to run), or ``--run-dir`` came without ``--log-with``.
    """
    from manygpu.tracking.registry import check_installed

    names = tuple(dict.fromkeys(name for group in ns.log_with or () for name in group))
    for name in names:
        check_installed(name)
    if ns.run_dir is not None and not names:
        raise UsageError(
            f"--run-dir is where the trackers of --log-with write; add --log-with ({KNOWN})"
        )
    return names, ns.run_dir
