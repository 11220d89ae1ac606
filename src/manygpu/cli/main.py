"""``manygpu`` entry point: dispatch to a subcommand, turn bad input into exit 2."""

from __future__ import annotations

import sys

from manygpu._version import __version__
from manygpu.cli import bench, checkpoint, demo, doctor, k8s, launch, plan
from manygpu.cli.parser import OneLineParser
from manygpu.errors import UsageError
from manygpu.runtime.heap import freeze_after_torch_import


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="manygpu", description="From one GPU to all of them.")
    parser.add_argument("--version", action="version", version=f"manygpu {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for module in (launch, demo, bench, plan, checkpoint, doctor, k8s):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    freeze_after_torch_import()  # the command's exit skips walking torch's objects
    parser = build_parser()
    ns = parser.parse_args(argv)
    if getattr(ns, "run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(ns.run(ns))
    except UsageError as exc:
        print(f"manygpu {ns.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
