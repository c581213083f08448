"""The package's docstring examples run as tests (`make test` and plain `pytest`).

pytest's `--doctest-modules` would also import every helper script under `tests/` (some
train a model at import, run as subprocesses); this hook collects the examples of the
package folders only. `agent/integrations/` is left out: each module there imports its
framework at import, and its examples need a framework's trainer (all are `+SKIP`).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest
from _pytest.doctest import DoctestModule

ROOT = Path(__file__).resolve().parent
#: The folders whose modules' examples run (the installed `ampwatch.*` packages).
DOCTEST_FOLDERS = ("agent", "server", "dashboard")
SKIPPED = (ROOT / "agent" / "integrations",)


class InstalledDoctestModule(DoctestModule):
    """A module's examples run in the module as installed (`ampwatch.server.step_models`),
    not in a second copy imported from its folder (`server.step_models`): a second copy of
    a table module would add its tables to the installed `Base.metadata` once more."""

    def _getobj(self) -> ModuleType:
        relative = self.path.relative_to(ROOT).with_suffix("")
        parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
        return importlib.import_module(".".join(("ampwatch", *parts)))


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    # A `__main__.py` runs its command at import (pytest's own doctest plugin skips it too).
    if file_path.suffix != ".py" or file_path.name == "__main__.py":
        return None
    if not file_path.is_relative_to(ROOT):
        return None
    relative = file_path.relative_to(ROOT)
    if relative.parts[0] not in DOCTEST_FOLDERS or any(
        file_path.is_relative_to(folder) for folder in SKIPPED
    ):
        return None
    return InstalledDoctestModule.from_parent(parent, path=file_path)
