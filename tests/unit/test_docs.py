"""The README and the documentation site (``docs/``) stay true to the code.

The commands in them are parsed by ``test_readme_commands.py``; here: every
Python block compiles and imports only names that exist, the README stays the
short door to the site (what manygpu is, the two commands, the five lines, a
map whose links all resolve), every page is in the site's navigation, and the
API reference documents every name ``manygpu`` exports. ``scripts/check``
builds the site itself with ``mkdocs build --strict`` (broken links, anchors and
docstring targets fail there).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import manygpu

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
SOURCES = [README, *sorted(DOCS.glob("*.md"))]


def python_blocks(text: str) -> list[str]:
    """The bodies of the fenced ``python`` blocks of a Markdown text."""
    fences = re.finditer(r"^```([^\n]*)\n(.*?)^```", text, re.S | re.M)
    return [m.group(2) for m in fences if m.group(1).strip() in ("python", "py")]


BLOCKS = [
    (f"{path.relative_to(ROOT)} block {i}", block)
    for path in SOURCES
    for i, block in enumerate(python_blocks(path.read_text()), 1)
]


def test_the_docs_have_python_blocks() -> None:
    assert len(BLOCKS) >= 15
    assert any(name.startswith("README.md") for name, _ in BLOCKS)


@pytest.mark.parametrize(("name", "block"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_python_block_compiles_and_imports_what_exists(name: str, block: str) -> None:
    """A block a reader copies parses, and each ``from manygpu... import x`` names a real x."""
    tree = ast.parse(block, filename=name)  # a SyntaxError names the block and line
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("manygpu"):
            module = importlib.import_module(str(node.module))
            missing = [a.name for a in node.names if not hasattr(module, a.name)]
            assert not missing, f"{name}: {node.module} has no {missing}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("manygpu"):
                    importlib.import_module(alias.name)


def test_the_readme_says_what_manygpu_is_before_its_commands() -> None:
    text = README.read_text()
    assert text.index("manygpu takes a PyTorch training script") < text.index("```bash")
    assert len(text.splitlines()) <= 150, "the README is the short door: guides go in docs/"


def test_the_readmes_map_links_every_page_and_only_pages_that_exist() -> None:
    text = README.read_text()
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)", text))
    pages = {f"docs/{p.name}" for p in DOCS.glob("*.md")}
    assert linked <= pages, f"README links missing pages: {sorted(linked - pages)}"
    assert pages - linked <= {"docs/index.md", "docs/benchmark-results.md"}, sorted(pages - linked)
    for target in re.findall(r"\]\(([^)#:]+)\)", text):
        assert (ROOT / target).exists(), f"README links {target}, which does not exist"


def test_every_page_is_in_the_sites_navigation() -> None:
    nav = set(re.findall(r":\s*([\w-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    assert nav == {p.name for p in DOCS.glob("*.md")}


def test_the_api_reference_documents_every_export() -> None:
    text = (DOCS / "reference.md").read_text()
    documented = {line.rsplit(".", 1)[1] for line in re.findall(r"^::: (\S+)$", text, re.M)}
    documented = {"available_strategies" if n == "available" else n for n in documented}
    assert documented == set(manygpu.__all__) - {"__version__"}
