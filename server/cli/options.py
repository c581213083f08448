"""What the command groups share: the collector's settings from flags, and the
`--database-url` flag of the commands that open the database themselves."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pydantic: imported by the commands that read settings, not by the parser
    from ampwatch.server.settings import Settings


def settings_from(args: argparse.Namespace) -> Settings:
    """Settings from the environment (AMPWATCH_*), overridden by explicit flags.

    >>> settings_from(argparse.Namespace(workers=2, no_migrate=True)).migrate
    False
    """
    from ampwatch.server.settings import Settings

    overrides = {
        key: value
        for key, value in {
            "host": getattr(args, "host", None),
            "port": getattr(args, "port", None),
            "database_url": getattr(args, "database_url", None),
            "workers": getattr(args, "workers", None),
        }.items()
        if value is not None
    }
    if getattr(args, "no_dashboard", False):
        overrides["dashboard"] = False
    if getattr(args, "no_migrate", False):
        overrides["migrate"] = False
    return Settings(**overrides)


def add_database_url(p: argparse.ArgumentParser) -> None:
    """`--database-url`, as `db`, `age-layer-stats` and `token` take it."""
    p.add_argument("--database-url", help="SQLAlchemy URL (AMPWATCH_DATABASE_URL)")
