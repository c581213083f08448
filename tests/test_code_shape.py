"""The code-health bars of the product packages (issue 30), checked with the suite so that
they hold after the refactor that met them: no module over `MAX_MODULE_LINES` lines, no
function over `MAX_FUNCTION_LINES` code lines (not blank, not a comment, its docstring left
out; a nested function counts toward its parent too). Complexity (<= 15) is ruff's `C90`.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agent", "server", "dashboard")
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80
MODULES = sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))

_LAYOUT = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
           tokenize.DEDENT, tokenize.ENDMARKER)  # fmt: skip


def code_lines(source: str) -> set[int]:
    """The line numbers that hold a token of code.

    >>> sorted(code_lines("x = 1\\n\\n# note\\ny = (\\n  2)\\n"))
    [1, 4, 5]
    """
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _LAYOUT:
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines


def long_functions(source: str) -> list[tuple[str, int]]:
    """(name, code lines) of every function over `MAX_FUNCTION_LINES`."""
    code = code_lines(source)
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        lines = set(range(node.lineno, (node.end_lineno or node.lineno) + 1)) & code
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            lines -= set(range(first.lineno, (first.end_lineno or first.lineno) + 1))
        if len(lines) > MAX_FUNCTION_LINES:
            out.append((node.name, len(lines)))
    return out


def test_the_walk_sees_the_packages() -> None:
    assert len(MODULES) > 100


@pytest.mark.parametrize("module", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_and_function_sizes(module: Path) -> None:
    source = module.read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES
    assert long_functions(source) == []


def test_a_long_function_is_caught() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    source = f'def f():\n    """Doc."""\n    # a comment\n\n{body}'
    assert long_functions(source) == [("f", MAX_FUNCTION_LINES + 1)]  # the def line counts
    assert long_functions(source.replace("    x0 = 0\n", "")) == []
