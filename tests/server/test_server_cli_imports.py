"""The `ampwatch` command imports what a command needs when it runs: building the parser
imports no torch, httpx, pydantic or SQLAlchemy, so the collector's extras alone and the
agent's extra alone each run their commands (the installs themselves:
tests/deploy/test_deploy_image.py), and `ampwatch token create` on a full install does not
spend ~5 s importing torch (before: every command imported it through the log parsers).
"""

from __future__ import annotations

import subprocess
import sys

from ampwatch.server.cli import tokens
from ampwatch.server.models import TOKEN_SCOPES

HEAVY = ("torch", "httpx", "pydantic", "sqlalchemy", "fastapi", "numpy", "dash")


def _imported_by(code: str) -> list[str]:
    probe = f"import sys\n{code}\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120, check=True)  # fmt: skip
    return list(eval(result.stdout.strip().splitlines()[-1]))


def test_building_the_parser_imports_no_heavy_library() -> None:
    assert _imported_by("from ampwatch.server.cli import build_parser; build_parser()") == []


def test_the_log_commands_import_no_collector_library() -> None:
    """`import` builds records from parsed numbers (`agent.records`: no torch); `follow`
    sends through the agent's sender (torch, which the `[agent]` extra has)."""
    assert _imported_by("import ampwatch.agent.logs.importer, ampwatch.agent.upload") == []
    imported = _imported_by("import ampwatch.agent.logs.follow")
    assert set(imported) <= {"torch", "numpy"}, imported


def test_the_token_command_imports_the_database_but_not_torch() -> None:
    code = (
        "from ampwatch.server.cli import main\n"
        "import tempfile, os, contextlib, io\n"
        "url = 'sqlite:///' + os.path.join(tempfile.mkdtemp(), 'a.db')\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['token', 'create', '--admin', '--database-url', url]) == 0"
    )
    imported = _imported_by(code)
    assert "sqlalchemy" in imported and "torch" not in imported


def test_the_parser_offers_the_stored_token_scopes() -> None:
    assert tokens.SCOPES == TOKEN_SCOPES
