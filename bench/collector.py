"""What the benches share: a collector in a subprocess, a throwaway PostgreSQL database,
and the CPU its processes use (Linux /proc)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

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


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (all its threads); 0 once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def collector_cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds used so far by the collector started as process `root`, split into its
    ingest processes (`server/ingest_pool.py`: the children of a multiprocessing
    forkserver) and the processes that serve requests (the rest: the server, or uvicorn's
    supervisor and workers). A process that already ended is not counted."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue

    def forkserver(pid: int) -> bool:
        try:
            return b"multiprocessing.forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False

    used = {"serving": 0.0, "ingest": 0.0}
    for pid in parents:
        chain, ingest = pid, False
        while chain not in (root, 0, 1) and chain in parents:
            ingest = ingest or forkserver(chain)
            chain = parents[chain]
        if chain == root:
            used["ingest" if ingest else "serving"] += process_cpu_seconds(pid)
    return used


def machine_idle_seconds() -> tuple[float, float]:
    """(idle, total) CPU seconds of the whole machine since boot (/proc/stat's cpu line)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    return (ticks[3] + ticks[4]) / hz, sum(ticks[:8]) / hz
