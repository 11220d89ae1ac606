"""Building the ``manygpu`` parser imports no torch, so ``manygpu --help`` answers at once;
nor does the driver of a launch over hosts (``manygpu launch -H``), which only starts ssh.

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

# The driver's whole code path: hostrun imports, at its top, every module the
# driver runs (its functions import nothing more).
DRIVE_HOSTS = f"""
import json, sys
from manygpu.cli.main import main
assert main(["launch", "-H", "localhost:1,192.0.2.1:1", "--dry-run", "train.py"]) == 0
import manygpu.launch.hosts.run
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


def test_the_driver_of_a_launch_over_hosts_imports_nothing_heavy() -> None:
    assert _heavy_after(DRIVE_HOSTS) == []
