"""Apply the schema migrations from code, with no alembic.ini and from any directory.

The revisions ship inside the package (`ampwatch.migrations`, the repository's `alembic/`
folder), so `ampwatch db upgrade` works wherever ampwatch is installed.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

import ampwatch.migrations


def alembic_config(database_url: str) -> Config:
    """An alembic `Config` pointing at the packaged migrations and at `database_url`."""
    # A namespace package (no __init__.py, so it cannot shadow the alembic library):
    # its location is its __path__, not a __file__.
    script_location = Path(next(iter(ampwatch.migrations.__path__)))
    config = Config()
    config.set_main_option("script_location", str(script_location))
    config.set_main_option("file_template", "%%(rev)s_%%(slug)s")
    config.attributes["database_url"] = database_url
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    """Migrate the database at `database_url` up to `revision`.

    >>> upgrade("sqlite:///ampwatch.db")  # doctest: +SKIP
    """
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str) -> None:
    """Migrate the database at `database_url` down to `revision` (`"base"`: no tables)."""
    command.downgrade(alembic_config(database_url), revision)


def head_revision() -> str:
    """The newest revision these migrations define (what `upgrade` brings a database to)."""
    head = ScriptDirectory.from_config(alembic_config("")).get_current_head()
    if head is None:  # pragma: no cover - the package always ships migrations
        raise RuntimeError("no migrations found in ampwatch.migrations")
    return head
