"""Alembic environment for ampwatch (installed as the `ampwatch.migrations` folder).

The database URL comes from, in order: `config.attributes["database_url"]` (set by
`ampwatch.server.migrate`, so URLs with `%` need no configparser escaping), the
`sqlalchemy.url` option of a developer's alembic.ini, then `Settings().database_url`.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import pool

from ampwatch.server.db import make_engine
from ampwatch.server.models import Base
from ampwatch.server.settings import Settings

config = context.config
target_metadata = Base.metadata


def database_url() -> str:
    url = config.attributes.get("database_url") or config.get_main_option("sqlalchemy.url")
    return str(url) if url else Settings().database_url


def run_migrations_offline() -> None:
    url = database_url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(database_url(), poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                # SQLite cannot ALTER most things; batch mode recreates the table instead.
                render_as_batch=connection.dialect.name == "sqlite",
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
