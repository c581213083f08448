"""ARCHITECTURE.md is the map: every module it lists exists, and every symbol it names in
backticks (a CONSTANT, a CamelCase type, a `module.name`) is defined in the package.

A map that names a module or a symbol that was renamed or removed sends a newcomer to the
wrong place (issue 30 found 3 wrong lines of 15 and `STEP_FIELDS`/`WireStep` in the "where
to change" table, which were `STEP_FLOAT_FIELDS`/`StepRecord`). This test reads the map as
text, so it fails the moment code and map part.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "ARCHITECTURE.md"
#: The map's section headings and the folder each one's module lines are relative to.
SECTIONS = {"**Agent**": "agent", "**Collector**": "server", "**Dashboard**": "dashboard"}
PACKAGES = ("agent", "server", "dashboard", "alembic", "bench", "tests")


def _expand(path: str) -> list[str]:
    """`alerts/{scale,spikes}.py` -> `alerts/scale.py`, `alerts/spikes.py`."""
    match = re.search(r"\{([^}]*)\}", path)
    if match is None:
        return [path]
    head, tail = path[: match.start()], path[match.end() :]
    return [p for part in match.group(1).split(",") for p in _expand(f"{head}{part}{tail}")]


def module_lines() -> list[tuple[str, str]]:
    """(folder, path as the map spells it) for each module a section's bullet lines name
    before their colon."""
    found: list[tuple[str, str]] = []
    folder: str | None = None
    for line in MAP.read_text(encoding="utf-8").splitlines():
        heading = next((f for h, f in SECTIONS.items() if line.startswith(h)), None)
        if heading is not None:
            folder = heading
            continue
        if line.startswith(("## ", "**")):
            folder = None
        if folder is None or not line.startswith("- "):
            continue
        named = line[2:].split(":", 1)[0]
        directory = ""  # `logs/importer.py`, `follow.py`: the later names share its folder
        for path in re.findall(r"`([^`]+\.py)`", named):
            if "/" in path:
                directory = path.rsplit("/", 1)[0] + "/"
            else:
                path = directory + path
            found.extend((folder, p) for p in _expand(path))
    return found


@cache
def defined_names() -> frozenset[str]:
    """Every top-level (and class-level) name defined in the project's Python files."""
    names: set[str] = set()
    for package in PACKAGES:
        for file in (ROOT / package).rglob("*.py"):
            tree = ast.parse(file.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Assign):
                    names.update(t.id for t in node.targets if isinstance(t, ast.Name))
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names.add(node.target.id)
    return frozenset(names)


def named_symbols() -> list[str]:
    """Backticked identifiers in the map that name code: CONSTANTS, CamelCase types and the
    last part of `module.name` (calls like `record()` included)."""
    symbols: list[str] = []
    prose = re.sub(r"```.*?```", "", MAP.read_text(encoding="utf-8"), flags=re.S)
    for text in re.findall(r"`([^`]+)`", prose):
        text = text.removesuffix("()")
        if not re.fullmatch(r"[A-Za-z_][\w.]*", text) or text.endswith(".py"):
            continue
        last = text.rsplit(".", 1)[-1]
        if last.startswith("AMPWATCH_"):  # an environment variable, not a symbol
            continue
        constant = re.fullmatch(r"[A-Z][A-Z0-9_]{2,}", last)
        camel = re.fullmatch(r"[A-Z][a-z]+[A-Z]\w*", last)
        qualified = "." in text and text.split(".", 1)[0] in {"deps", "wire", "alerts", "rollups"}
        if constant or camel or qualified:
            symbols.append(last)
    return symbols


def test_the_map_lists_modules_at_all() -> None:
    assert len(module_lines()) > 60


@pytest.mark.parametrize(("folder", "path"), module_lines())
def test_every_module_the_map_lists_exists(folder: str, path: str) -> None:
    assert (ROOT / folder / path).is_file(), f"ARCHITECTURE.md names {folder}/{path}"


def test_every_symbol_the_map_names_is_defined() -> None:
    symbols = named_symbols()
    assert symbols, "the map names no symbol: the pattern above no longer reads it"
    missing = sorted({s for s in symbols if s not in defined_names()})
    assert not missing, f"ARCHITECTURE.md names symbols defined nowhere: {missing}"
