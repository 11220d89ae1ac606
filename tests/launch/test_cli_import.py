"""Building the ``manygpu`` parser imports no torch, so ``manygpu --help`` answers at once.

Each check runs in a fresh interpreter (this one has torch loaded already).
"""

from __future__ import annotations

import json
import subprocess
import sys

from jobs import ROOT, subprocess_env

HEAVY = ("torch", "numpy", "rich", "matplotlib", "sklearn")
"""Libraries that take a noticeable part of a second to import."""

BUILD_PARSER = f"""
import json, sys
from manygpu.cli.main import build_parser
build_parser()
print(json.dumps([name for name in {HEAVY!r} if name in sys.modules]))
"""

# Replace every subpackage's __init__ by an empty package, as a lazy (PEP 562)
# one is, so the check covers the CLI's own imports whatever those files do.
EMPTY_PACKAGES = """
import pathlib, sys, types
import manygpu
root = pathlib.Path(manygpu.__file__).parent
for init in root.rglob("__init__.py"):
    name = ".".join(init.parent.relative_to(root.parent).parts)
    if name != "manygpu":
        package = types.ModuleType(name)
        package.__path__ = [str(init.parent)]
        sys.modules[name] = package
"""


def _heavy_after(code: str) -> list[str]:
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return list(json.loads(res.stdout.strip().splitlines()[-1]))


def test_cli_modules_import_nothing_heavy_to_build_the_parser() -> None:
    assert _heavy_after(EMPTY_PACKAGES + BUILD_PARSER) == []


def test_building_the_parser_imports_nothing_heavy() -> None:
    assert _heavy_after(BUILD_PARSER) == []
