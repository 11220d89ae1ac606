"""``manygpu checkpoint inspect|export``: look inside a checkpoint, export its weights."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from manygpu.cli.parser import OneLineParser
from manygpu.errors import UsageError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("checkpoint", help="inspect or export checkpoints")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", parser_class=OneLineParser, required=True)
    i = verbs.add_parser("inspect", help="what a checkpoint holds, and whether it verifies")
    i.add_argument("path", help="a checkpoint directory (step-N) or their parent (newest)")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(run=run_inspect)
    e = verbs.add_parser("export", help="write the model weights as safetensors")
    e.add_argument("path", help="a checkpoint directory (step-N) or their parent (newest)")
    e.add_argument("out", help="output .safetensors file")
    e.set_defaults(run=run_export)


def _existing(path: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{path} does not exist; give a checkpoint directory")
    return p


def run_inspect(ns: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from manygpu.checkpoint.export import inspect
    from manygpu.errors import CheckpointError

    try:
        info = inspect(_existing(ns.path))
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    if ns.json:
        print(json.dumps(info, indent=2))
    else:
        table = Table(title=f"checkpoint {info['path']}", show_header=False)
        for key in (
            "status",
            "step",
            "epoch",
            "format",
            "strategy",
            "world_size",
            "precision",
            "created",
            "model_tensors",
            "model_parameters",
            "dtypes",
            "bytes",
            "loader",
            "extra",
        ):
            table.add_row(key, str(info[key]))
        for name, size in info["files"].items():
            table.add_row(f"  {name}", f"{size:,} bytes")
        Console(soft_wrap=True).print(table)
    return 0 if info["status"] == "ok" else 1


def run_export(ns: argparse.Namespace) -> int:
    from manygpu.checkpoint.export import export_safetensors
    from manygpu.errors import CheckpointError

    try:
        summary = export_safetensors(_existing(ns.path), Path(ns.out))
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    print(
        f"wrote {ns.out}: {summary['tensors']} tensors, {summary['parameters']:,} parameters "
        f"from {summary['checkpoint']}"
    )
    return 0
