"""Lay out the installed package names as a tree of links, for mypy.

The folders are installed under `ampwatch.*` through `[tool.setuptools.package-dir]`, and
the editable install reaches them through an import hook that mypy cannot follow
(pypa/setuptools#3539): without this tree, every `ampwatch.*` import would be `Any`. The
tree is built from the same mapping the install uses, so it cannot drift from it, and links
folders (not files), so a new module is checked without reinstalling.

    python .ci/package_tree.py build/typecheck   # then: mypy (mypy_path = build/typecheck)
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # the `server` extra installs tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def build(target: Path) -> None:
    """Link `target/ampwatch/<name>` to each folder the install maps `ampwatch.<name>` to."""
    with (ROOT / "pyproject.toml").open("rb") as file:
        mapping: dict[str, str] = tomllib.load(file)["tool"]["setuptools"]["package-dir"]
    for package, folder in mapping.items():
        link = target.joinpath(*package.split("."))
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(ROOT / folder, target_is_directory=True)


if __name__ == "__main__":
    build(Path(sys.argv[1]))
