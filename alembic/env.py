"""Alembic environment for ampwatch (installed as the `ampwatch.migrations` folder).

The database URL comes from, in order: `config.attributes["database_url"]` (set by
`ampwatch.server.migrate`, so URLs with `%` need no configparser escaping), the
`sqlalchemy.url` option of a developer's alembic.ini, then `Settings().database_url`.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import pool

# Imported for their tables: each table module adds its own to `Base.metadata`.
from ampwatch.server import layer_models, step_models  # noqa: F401
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
            if connection.dialect.name == "sqlite":
                # Batch mode rebuilds a table by copying it and dropping the original; with
                # foreign keys enforced that DROP would cascade-delete every child row. The
                # pragma is a no-op inside a transaction, so it goes to the driver before
                # the migration's transaction begins (NullPool: the connection is discarded).
                connection.connection.driver_connection.execute(  # type: ignore[union-attr]
                    "PRAGMA foreign_keys=OFF"
                )
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                # SQLite cannot ALTER most things; batch mode recreates the table instead.
                render_as_batch=connection.dialect.name == "sqlite",
            )
            with context.begin_transaction():
                context.run_migrations()
            if connection.dialect.name == "sqlite":
                broken = connection.exec_driver_sql("PRAGMA foreign_key_check").all()
                if broken:
                    raise RuntimeError(f"migration left dangling foreign keys: {broken[:5]}")
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
