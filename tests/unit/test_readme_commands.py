"""Every ``manygpu ...`` command the README and the docs (``docs/*.md``) show parses.

A new user copies these lines first; a flag that the CLI refuses (the README
once showed ``bench comm --markdown`` before the command had it) is the first
thing they meet. The lines come from the fenced code blocks (not the Python ones)
of README.md and every page of the documentation site, and from the code spans of
their tables; each is parsed by
:func:`manygpu.cli.main.build_parser` (``python -m manygpu.emulate`` lines by
that module's own parser), so a missing subcommand, an unknown flag or a value
its type refuses fails here, naming the line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from manygpu.cli.main import build_parser
from manygpu.emulate.__main__ import build_parser as emulate_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SOURCES = [README, *sorted((ROOT / "docs").glob("*.md"))]
"""The files whose commands are checked: the README and every documentation page."""

NOT_COMMANDS: dict[str, str] = {
    "manygpu       the package: lazy re-exports for users (import manygpu loads no torch)": (
        "the Layout section's tree of folders, not a command"
    ),
}
"""Lines that mention ``manygpu`` like a command but are not one, each with the reason.
A line here must still be in the README or a page of docs/ (a test checks), so the list
cannot rot."""

PLACEHOLDERS: dict[str, str | None] = {
    "...": None,  # "and the rest of your flags": dropped
    "N": "2",  # "--max-restarts N": any count
    "MIN:MAX": "1:4",  # "--nnodes MIN:MAX": an elastic range
}
"""Whole words the README writes as placeholders, and the value checked in their place
(``None``: the word is left out). Only whole words are replaced."""

PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "manygpu": build_parser,
    "manygpu.emulate": emulate_parser,
}
"""The programs README lines may run, by name (``python -m NAME`` or the ``manygpu`` script)."""


MENTION = re.compile(r"(^|[\s/])manygpu(\s|$)|-m manygpu")
"""A line that may run manygpu (the program's name as a word, or ``-m manygpu...``)."""


def _blocks(text: str) -> Iterator[str]:
    """The lines of every fenced block that is not Python, continuations joined."""
    for m in re.finditer(r"^```([^\n]*)\n(.*?)^```", text, re.S | re.M):
        if m.group(1).strip() in ("python", "py"):
            continue
        yield from m.group(2).replace("\\\n", " ").splitlines()


def _table_spans(text: str) -> Iterator[str]:
    """The code spans of table rows."""
    for line in text.splitlines():
        if line.lstrip().startswith("|"):
            yield from re.findall(r"`([^`]+)`", line)


WRAPPERS = frozenset({"sudo", "srun", "mpirun", "exec", "env", "python", "python3"})
"""Programs that run the command after their own options (``srun ... manygpu launch``)."""


def _program(words: list[str]) -> tuple[str, list[str]] | None:
    """(program, its arguments) when ``words`` run manygpu, else None.

    manygpu must be the first word, or come after a wrapper's (prose that names
    manygpu later in a line is not a command)."""
    if not words or not (_is_manygpu(words[0]) or words[0] in WRAPPERS):
        return None
    for i, word in enumerate(words):
        if _is_manygpu(word):
            return "manygpu", words[i + 1 :]
        if word == "-m" and i + 1 < len(words) and words[i + 1].startswith("manygpu"):
            module = words[i + 1].removesuffix(".__main__")
            return module, words[i + 2 :]
    return None


def _is_manygpu(word: str) -> bool:
    return word == "manygpu" or word.endswith("/manygpu")


def commands(text: str) -> list[tuple[str, str, list[str]]]:
    """(README line, program, arguments) for every manygpu command line in ``text``."""
    found = []
    for line in [*_blocks(text), *_table_spans(text)]:
        if line.strip() in NOT_COMMANDS or not MENTION.search(line):
            continue  # output, prose, other tools: a quote there need not be shell's
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        segment: list[str] = []
        for word in [*lexer, ";"]:
            if word not in ("|", "||", "&&", ";", "&"):
                segment.append(word)
                continue
            hit = _program(segment)
            if hit is not None:
                args = [PLACEHOLDERS.get(w, w) for w in hit[1]]
                found.append((line.strip(), hit[0], [a for a in args if a is not None]))
            segment = []
    return found


def refusal(program: str, args: list[str]) -> str | None:
    """Why ``program``'s real parser refuses ``args`` (None: it accepts them)."""
    if program not in PARSERS:
        return f"no parser known for python -m {program}; add it to PARSERS"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            PARSERS[program]().parse_args(args)
    except SystemExit as exc:
        return err.getvalue().strip() or f"exit {exc.code}"
    return None


FOUND = [
    (f"{path.relative_to(ROOT)}: {line}", program, args)
    for path in SOURCES
    for line, program, args in commands(path.read_text())
]


def test_the_readme_shows_commands_of_every_kind() -> None:
    """The extraction finds what a reader sees: blocks, wrapped lines, tables, wrappers."""
    lines = {line.split(": ", 1)[1] for line, _, _ in FOUND}
    assert len(FOUND) >= 30
    assert any(line.startswith("srun ") for line in lines)  # after a wrapper
    assert any("| kubectl" in line for line in lines)  # a pipeline, joined from two lines
    pages = {line.split(": ", 1)[0] for line, _, _ in FOUND}
    assert {"README.md", "docs/launching.md", "docs/checkpoints.md"} <= pages
    programs = [(p, args[:2]) for _, p, args in FOUND]
    assert ("manygpu", ["launch", "--nnodes"]) in programs  # from a table's code span


@pytest.mark.parametrize(("line", "program", "args"), FOUND, ids=[f[0][:80] for f in FOUND])
def test_readme_command_parses(line: str, program: str, args: list[str]) -> None:
    assert refusal(program, args) is None, f"line refused: {line}\n{refusal(program, args)}"


def test_the_check_refuses_what_the_cli_refuses() -> None:
    text = (
        "```bash\nmanygpu bench comm --no-such-flag 1\nmanygpu nope\n```\n"
        "| a | `manygpu plan --batch x` |\n"
    )
    found = commands(text)
    assert [f[1:] for f in found] == [
        ("manygpu", ["bench", "comm", "--no-such-flag", "1"]),
        ("manygpu", ["nope"]),
        ("manygpu", ["plan", "--batch", "x"]),
    ]
    for _, program, args in found:
        assert refusal(program, args) is not None
    assert refusal("manygpu.nothing", []) is not None
    emulate = commands("```\nsudo python -m manygpu.emulate --hosts two -- true\n```\n")
    assert refusal(*emulate[0][1:]) is not None


def test_every_allowed_non_command_is_still_in_the_docs() -> None:
    lines = {line.strip() for path in SOURCES for line in _blocks(path.read_text())}
    assert set(NOT_COMMANDS) <= lines


def test_a_bf16_example_tells_a_cpu_user_to_use_fp32() -> None:
    """The first example a user copies asks for bf16, which a CPU emulates (2.3x slower
    measured on the demo's loop): the paragraph after it says what to use there."""
    text = README.read_text()
    example = text.index('precision="bf16")')
    after = text[text.index("```\n", example) + 4 :].strip().split("\n\n", 1)[0]
    assert "On a CPU" in after and '"fp32"' in after, after
