"""One home per value: the URL prefixes are spelled once (`agent/wire.py`) and the
`AMPWATCH_*` environment is read in its two settings homes only (`agent/config.py` for
the training side, `server/settings.py` for the collector and the dashboard).

A second spelling drifts (issue 30 found `/api/v1` and `/dashboard` in five places each
and six variables read elsewhere, where a default or a parse could differ). The test reads
the package sources; tests and docs may spell them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agent", "server", "dashboard")
PREFIXES = ("/api/v1", "/dashboard")
PREFIX_HOME = "agent/wire.py"
SETTINGS_HOMES = ("agent/config.py", "server/settings.py")


def _sources() -> list[tuple[str, ast.Module]]:
    return [
        (path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(encoding="utf-8")))
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    ]


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring constants (prose may name a URL)."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            found.add(id(first.value))
    return found


def url_pieces(tree: ast.Module) -> list[str]:
    """String constants (f-string pieces included) that start or end with a URL prefix:
    a URL being built, not prose that mentions one.

    >>> url_pieces(ast.parse('x = f"{url}/api/v1"\\ny = "see /dashboard/ for it"'))
    ['/api/v1']
    """
    docs = _docstrings(tree)
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if id(node) not in docs
        if any(node.value.startswith(p) or node.value.endswith(p) for p in PREFIXES)
    ]


def environment_reads(tree: ast.Module) -> list[str]:
    """`AMPWATCH_*` names read through `os.environ` / `os.getenv`.

    >>> environment_reads(ast.parse('import os\\nos.environ.get("AMPWATCH_URL")'))
    ['AMPWATCH_URL']
    """
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            reader, args = ast.unparse(node.func), node.args
        elif isinstance(node, ast.Subscript):
            reader, args = ast.unparse(node.value), [node.slice]
        else:
            continue
        if reader.endswith(("environ.get", "getenv", "environ")):
            found += [
                a.value
                for a in args[:1]
                if isinstance(a, ast.Constant) and str(a.value).startswith("AMPWATCH_")
            ]
    return found


def test_url_prefixes_are_spelled_once() -> None:
    spelled = {path: pieces for path, tree in _sources() if (pieces := url_pieces(tree))}
    assert spelled == {PREFIX_HOME: ["/api/v1", "/dashboard"]}


def test_the_environment_is_read_in_the_settings_homes_only() -> None:
    reads = {
        path: names
        for path, tree in _sources()
        if path not in SETTINGS_HOMES and (names := environment_reads(tree))
    }
    assert reads == {}
