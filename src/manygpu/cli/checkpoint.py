"""``manygpu checkpoint inspect|export``: look inside a checkpoint, export its weights.

Everything printed from a checkpoint (``meta.json``'s strings, file and
directory names, errors quoting them) goes through :func:`shown`: a crafted
checkpoint must not be able to retitle, clear or rewrite the terminal of
whoever inspects it. Table cells are rich ``Text``, never parsed as markup.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from manygpu.cli.parser import OneLineParser
from manygpu.errors import UsageError

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")
"""C0 and C1 controls (ESC, CSI, BEL, CR ...), and the invisible or reordering
Unicode formats (zero widths, bidi overrides, line separators)."""


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def shown(value: Any) -> str:
    """``str(value)`` with each control character written as a visible escape (``\\x1b``)."""

    def escape(match: re.Match[str]) -> str:
        char = match.group()
        code = ord(char)
        named = _NAMED.get(char)
        return named or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")

    return _CONTROL.sub(escape, str(value))


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
    from rich.text import Text

    from manygpu.checkpoint.export import inspect
    from manygpu.errors import CheckpointError

    try:
        info = inspect(_existing(ns.path))
    except CheckpointError as exc:
        raise UsageError(shown(exc)) from None
    if ns.json:  # JSON escapes every control character itself (ensure_ascii)
        print(json.dumps(info, indent=2))
    else:
        table = Table(title=Text(f"checkpoint {shown(info['path'])}"), show_header=False)
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
            table.add_row(key, Text(shown(info[key])))
        for name, size in info["files"].items():
            table.add_row(Text(f"  {shown(name)}"), f"{size:,} bytes")
        Console(soft_wrap=True).print(table)
    return 0 if info["status"] == "ok" else 1


def run_export(ns: argparse.Namespace) -> int:
    from manygpu.checkpoint.export import export_safetensors
    from manygpu.errors import CheckpointError

    try:
        summary = export_safetensors(_existing(ns.path), Path(ns.out))
    except CheckpointError as exc:
        raise UsageError(shown(exc)) from None
    print(
        f"wrote {shown(ns.out)}: {summary['tensors']} tensors, {summary['parameters']:,} "
        f"parameters from {shown(summary['checkpoint'])}"
    )
    return 0
