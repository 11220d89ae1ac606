"""CI runs exactly the README's test command, and that command runs every check."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _commands(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    demo, check = _commands(first_block)
    assert demo.endswith("manygpu demo")
    ci = _commands((ROOT / ".ci" / "run").read_text())
    assert ci[-1] == check, f".ci/run ends with {ci[-1]!r}; the README's test command is {check!r}"


def test_the_test_command_lints_type_checks_and_tests() -> None:
    script = _commands((ROOT / "scripts" / "check").read_text())
    steps = [
        "-e '.[dev]'",
        "ruff check",
        "ruff format --check",
        "mypy",
        "mkdocs build --strict",
        "pytest",
    ]
    found = [next(i for i, ln in enumerate(script) if step in ln) for step in steps]
    assert found == sorted(found), f"scripts/check must run {steps} in that order"
    # mypy and the docs run beside the tests: each failure, pytest's included, is the script's.
    pytest_line = next(ln for ln in script if ln.startswith(".venv/bin/python -m pytest"))
    assert pytest_line.endswith("|| rc=$?"), pytest_line
    assert 'echo 1 >"$side/mypy.rc"' in "\n".join(script)
    assert script[-1] == 'exit "${rc:-0}"', script[-1]
