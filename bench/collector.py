"""What both benches share: a collector in a subprocess, a throwaway PostgreSQL database."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import httpx

from ampwatch.server.serving import bind_socket

POSTGRES_ADMIN_URL = os.environ.get(
    "AMPWATCH_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test"
)


def start_server(
    database_url: str, *, dashboard: bool = False, workers: int = 1
) -> tuple[subprocess.Popen[bytes], str]:
    """`ampwatch serve` in a subprocess on a free port (with its dashboard mounted at
    /dashboard/ when `dashboard`, with `workers` uvicorn worker processes); returns it and
    its base URL."""
    sock = bind_socket()
    port = sock.getsockname()[1]
    sock.close()
    env = {
        **os.environ,
        "AMPWATCH_DATABASE_URL": database_url,
        "AMPWATCH_PORT": str(port),
        "AMPWATCH_DASHBOARD": "true" if dashboard else "false",
        "AMPWATCH_WORKERS": str(workers),
    }
    code = (
        "from ampwatch.server.serving import serve; from ampwatch.server.settings import "
        "Settings; serve(Settings())"
    )
    process = subprocess.Popen([sys.executable, "-c", code], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180  # imports alone take a minute on a loaded 2-core machine
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("the collector did not start")


def postgres_database() -> str | None:
    """A fresh database on the local PostgreSQL, or None when it is unreachable."""
    import psycopg
    from psycopg import sql
    from sqlalchemy.engine import make_url

    name = f"ampwatch_bench_{uuid.uuid4().hex[:8]}"
    try:
        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=3) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    except psycopg.OperationalError as error:
        print(f"postgres   skipped: {error}".strip())
        return None
    url = make_url(POSTGRES_ADMIN_URL).set(drivername="postgresql+psycopg", database=name)
    return url.render_as_string(hide_password=False)


def drop_postgres_database(database_url: str) -> None:
    import psycopg
    from psycopg import sql
    from sqlalchemy.engine import make_url

    name = make_url(database_url).database
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
