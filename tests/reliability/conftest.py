"""Reliability fixtures: a freshly migrated PostgreSQL database, collectors as real
processes (`ampwatch serve --workers N --no-migrate`), exact row counts, and the figures
table printed at the end of the session (`reliability_procs`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from reliability_procs import (
    CollectorProcess,
    RowCounter,
    answers,
    free_port,
    terminal_summary,
    wait_for,
)
from sqlalchemy.engine import make_url


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminal_summary(terminalreporter)


@pytest.fixture
def migrated_postgres(postgres_url: str) -> str:
    """A fresh PostgreSQL database migrated by the CLI, as the compose `migrate` step does."""
    # A password in the URL (trust auth ignores it) must not reach the logs.
    with_password = make_url(postgres_url).set(password="not-in-the-logs")
    result = subprocess.run(
        [sys.executable, "-m", "ampwatch.server.cli", "db", "upgrade",
         "--database-url", with_password.render_as_string(hide_password=False)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "upgrade done" in result.stdout and "not-in-the-logs" not in result.stdout
    return postgres_url


@pytest.fixture
def collector_process(migrated_postgres: str) -> Iterator[Callable[..., CollectorProcess]]:
    """Factory: `collector_process(workers=2, port=None, env={...})`, started; all stopped
    (and their database connections closed) at the end of the test."""
    started: list[CollectorProcess] = []

    def start(*, workers: int = 2, port: int | None = None, **env: str) -> CollectorProcess:
        collector = CollectorProcess(
            migrated_postgres, port or free_port(), workers=workers, env=env
        ).start()
        started.append(collector)
        return collector

    yield start
    for collector in started:
        collector.stop()


@pytest.fixture
def rows(migrated_postgres: str) -> Iterator[RowCounter]:
    counter = RowCounter(migrated_postgres)
    yield counter
    counter.close()


@pytest.fixture
def dashboard_process() -> Iterator[Callable[..., str]]:
    """Factory: `python -m ampwatch.dashboard` alone against `api_url`, with `token`."""
    processes: list[subprocess.Popen[bytes]] = []

    def start(api_url: str, token: str) -> str:
        port = free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "ampwatch.dashboard", "--api-url", api_url,
             "--host", "127.0.0.1", "--port", str(port)],
            env={**os.environ, "AMPWATCH_DASHBOARD_TOKEN": token},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        processes.append(process)
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            if process.poll() is not None:
                stderr = process.stderr.read().decode() if process.stderr else ""
                raise RuntimeError(f"the dashboard exited: {stderr}")
            return answers(url, "/")

        wait_for(up, timeout=60, what="the dashboard")
        return url

    yield start
    for process in processes:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stderr is not None:
            process.stderr.close()
