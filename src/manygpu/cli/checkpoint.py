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
    i = verbs.add_parser("inspect", help="what checkpoints hold, and whether they verify")
    i.add_argument(
        "path", help="a checkpoint directory (step-N): what it holds; or their parent: every one"
    )
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(run=run_inspect)
    e = verbs.add_parser("export", help="write the model weights as safetensors")
    e.add_argument("path", help="a checkpoint directory (step-N) or their parent (newest)")
    e.add_argument(
        "out",
        help="a .safetensors file (one file), or a new directory: Hugging Face's layout "
        "(model.safetensors, or numbered files and an index above --max-shard-size)",
    )
    e.add_argument(
        "--max-shard-size",
        type=_size,
        default=None,
        metavar="SIZE",
        help="largest file of a directory export, e.g. 2G (default: 5 GB, as Hugging Face)",
    )
    e.add_argument(
        "--step", type=_step, metavar="N", help="step N's checkpoint under PATH (default: newest)"
    )
    e.add_argument(
        "--dtype", choices=("bf16", "fp16", "fp32"), help="cast floating tensors to this type"
    )
    e.set_defaults(run=run_export)


def _size(text: str) -> int:
    from manygpu.flags import SIZE_EXAMPLES, parse_size

    try:
        size = parse_size(text, "--max-shard-size")
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"--max-shard-size {text!r} must be 1 byte or more; "
                                         f"{SIZE_EXAMPLES}")  # fmt: skip
    return size


def _step(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a step number (an integer >= 0)")
    return int(text)


def _existing(path: str) -> Path | str:
    """A local checkpoint path that exists, or a URL as it was given (checked where read)."""
    from manygpu.checkpoint_io.remote import is_url

    if is_url(path):
        return path
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{path} does not exist; give a checkpoint directory")
    return p


def _number(value: Any, unit: str = "") -> str:
    """Every number the same way: thousands separators (``130,713 bytes``); None as ``-``."""
    if value is None:
        return "-"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}{unit}"
    return shown(value)


def run_inspect(ns: argparse.Namespace) -> int:
    from manygpu.checkpoint_io.layout import META

    path = _existing(ns.path)
    if isinstance(path, str):
        return _inspect_url(path, ns.json)
    if (path / META).is_file():
        return _inspect_one(path, ns.json)
    return _inspect_all(path, ns.json)


def _inspect_url(url: str, as_json: bool) -> int:
    """``inspect`` of a URL: one step (it holds a meta.json) or every step under it."""
    from manygpu.checkpoint_io import remote, remote_layout
    from manygpu.checkpoint_io.layout import META
    from manygpu.errors import CheckpointError

    root = remote.connect(url)  # a missing backend: one UsageError line
    try:
        if META in remote_layout.objects(root):
            return _inspect_one(url, as_json)
        return _inspect_all(root, as_json)
    except (CheckpointError, OSError) as exc:
        raise UsageError(f"cannot inspect {shown(url)}: {shown(exc)}") from None


_ROWS = (
    "status",
    "step",
    "epoch",
    "sample",
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
)


def _inspect_one(path: Path | str, as_json: bool) -> int:
    """One checkpoint: what it holds, file by file."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from manygpu.checkpoint.export import inspect
    from manygpu.errors import CheckpointError

    try:
        info = inspect(path)
    except CheckpointError as exc:
        raise UsageError(shown(exc)) from None
    if as_json:  # JSON escapes every control character itself (ensure_ascii)
        print(json.dumps(info, indent=2))
    else:
        table = Table(title=Text(f"checkpoint {shown(info['path'])}"), show_header=False)
        for key in _ROWS:
            value = ", ".join(info[key]) if key == "dtypes" else info[key]
            table.add_row(key, Text(_number(value, " bytes" if key == "bytes" else "")))
        for name, size in info["files"].items():
            table.add_row(Text(f"  {shown(name)}"), Text(_number(size, " bytes")))
        Console(soft_wrap=True).print(table)
    return 0 if info["status"] == "ok" else 1


def _inspect_all(root: Any, as_json: bool) -> int:
    """Every checkpoint under ``root``, one row each; exit 1 if any is not complete
    (a ``corrupt-step-N`` a resume already moved aside does not count: it is handled)."""
    from manygpu.checkpoint.listing import COMPLETE, list_checkpoints

    rows = list_checkpoints(root)
    if not rows:
        raise UsageError(
            f"no checkpoints in {shown(root)}; give the directory a Checkpointer saves into"
        )
    if as_json:
        print(json.dumps({"path": str(root), "checkpoints": rows}, indent=2))
    else:
        _print_rows(root, rows)
    return 0 if all(r["state"] == COMPLETE or r["moved_aside"] for r in rows) else 1


def _print_rows(root: Any, rows: list[dict[str, Any]]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from manygpu.checkpoint.listing import COMPLETE

    table = Table(title=Text(f"checkpoints in {shown(root)}"), box=box.SIMPLE, pad_edge=False)
    table.add_column("checkpoint", no_wrap=True)
    for header in ("step", "epoch", "sample", "world", "format", "bytes"):
        table.add_column(header, justify="left" if header == "format" else "right", no_wrap=True)
    table.add_column("state", min_width=len("incomplete"))
    for r in rows:
        state = r["state"] + (" (moved aside)" if r["moved_aside"] else "")
        cells = (r["step"], r["epoch"], r["sample"], r["world_size"], r["format"], r["bytes"])
        table.add_row(Text(shown(r["name"])), *(Text(_number(c)) for c in cells), Text(state))
    console = Console(soft_wrap=True)
    console.print(table)
    for r in rows:
        if r["problem"]:
            console.print(Text(f"{shown(r['name'])}: {shown(r['problem'])}"))
    good = [r for r in rows if r["state"] == COMPLETE]
    if good:
        newest = shown(root / good[-1]["name"])
        console.print(Text(f"what one holds: manygpu checkpoint inspect {newest}"))


def run_export(ns: argparse.Namespace) -> int:
    from manygpu.checkpoint.export import export_safetensors
    from manygpu.errors import CheckpointError

    sizes = {} if ns.max_shard_size is None else {"max_shard_bytes": ns.max_shard_size}
    path = _existing(ns.path)
    try:
        summary = export_safetensors(path, Path(ns.out), step=ns.step, dtype=ns.dtype, **sizes)
    except CheckpointError as exc:
        raise UsageError(shown(exc)) from None
    except OSError as exc:  # a store's error (a local one is the disk's: shown as it was)
        if not isinstance(path, str):
            raise
        raise UsageError(f"cannot export from {shown(path)}: {shown(exc)}") from None
    files = f" in {summary['files']} files" if summary["files"] > 1 else ""
    print(
        f"wrote {shown(ns.out)}{files}: {summary['tensors']:,} tensors, {summary['parameters']:,} "
        f"parameters ({', '.join(summary['dtypes'])}), {summary['bytes']:,} bytes, "
        f"from {shown(summary['checkpoint'])}"
    )
    for dropped, kept in summary["tied"].items():
        print(f"tied: {shown(dropped)} is {shown(kept)}, stored once (recorded in the metadata)")
    return 0
