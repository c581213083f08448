"""Reliability helpers: collectors as real processes (`ampwatch serve --workers N`) that
tests can SIGKILL, a fault-injecting HTTP proxy, exact row counts, and a figures table
printed at the end of the session (the numbers the README's reliability section quotes).

Bounded versions of the long runs in `bench/soak.py`; every test here runs against the
PostgreSQL server on 127.0.0.1:5432 (a fresh database per test) and skips without it.
`bench/soak.py` runs its collector with `CollectorProcess` from here (imported by file
name: it puts this folder on `sys.path`).
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from sqlalchemy import func, select

from ampwatch.server.db import make_engine
from ampwatch.server.models import Base
from ampwatch.server.serving import bind_socket

if TYPE_CHECKING:  # typing.Self is Python 3.11+
    from typing_extensions import Self

#: name -> list of "figure" lines, printed by `pytest_terminal_summary`.
FIGURES: dict[str, list[str]] = {}


def record_figure(test: str, line: str) -> None:
    FIGURES.setdefault(test, []).append(line)
    print(f"[{test}] {line}")


def terminal_summary(terminalreporter: Any) -> None:
    if FIGURES:
        terminalreporter.section("ampwatch reliability figures")
        for test, lines in FIGURES.items():
            for line in lines:
                terminalreporter.write_line(f"{test}: {line}")


def free_port() -> int:
    sock = bind_socket()
    port = int(sock.getsockname()[1])
    sock.close()
    return port


def wait_for(condition: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        time.sleep(0.05)


def answers(url: str, path: str = "/readyz") -> bool:
    try:
        return httpx.get(url + path, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class CollectorProcess:
    """`ampwatch serve --workers N --no-migrate` in its own process group, so that a test
    can SIGKILL the supervisor and every worker at once, as a crashed host would."""

    database_url: str
    port: int
    workers: int = 2
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> CollectorProcess:
        env = {
            **os.environ,
            "AMPWATCH_DATABASE_URL": self.database_url,
            "AMPWATCH_PORT": str(self.port),
            "AMPWATCH_DASHBOARD": "false",
            **self.env,
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ampwatch.server.cli", "serve", "--no-migrate",
             "--workers", str(self.workers)],
            env=env, start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while not answers(self.url):
            if self.process.poll() is not None:
                stderr = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"collector exited: {stderr}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("the collector did not become ready")
            time.sleep(0.1)
        return self

    def worker_pids(self) -> list[int]:
        """The uvicorn worker processes (children of the supervisor)."""
        assert self.process is not None
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])
            if ppid == self.process.pid:
                pids.append(int(entry.name))
        return [pid for pid in pids if _is_worker(pid)]

    def kill(self) -> None:
        """SIGKILL the supervisor and all its workers (the process group)."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)
        if self.process.stderr is not None:
            self.process.stderr.close()
        self.process = None

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.kill()


def _is_worker(pid: int) -> bool:
    """A uvicorn worker (multiprocessing's spawn), not its resource tracker."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return "spawn_main" in cmdline and "resource_tracker" not in cmdline


class RowCounter:
    """Exact row counts of every table, through SQLAlchemy (no SQL text)."""

    def __init__(self, database_url: str) -> None:
        self.engine = make_engine(database_url)

    def counts(self) -> dict[str, int]:
        with self.engine.connect() as connection:
            return {
                name: connection.scalar(select(func.count()).select_from(table)) or 0
                for name, table in Base.metadata.tables.items()
            }

    def data_counts(self) -> tuple[int, ...]:
        """Rows of the tables a batch writes, in one round trip (for per-request checks)."""
        from ampwatch.server.layer_models import LayerStat
        from ampwatch.server.models import Event, IngestedBatch, Run
        from ampwatch.server.step_models import Step

        tables = (Run, IngestedBatch, Step, LayerStat, Event)
        statement = select(*(select(func.count()).select_from(t).scalar_subquery() for t in tables))
        with self.engine.connect() as connection:
            return tuple(connection.execute(statement).one())

    def scalar(self, statement: Any) -> Any:
        with self.engine.connect() as connection:
            return connection.scalar(statement)

    def rows(self, statement: Any) -> list[Any]:
        with self.engine.connect() as connection:
            return list(connection.execute(statement))

    def close(self) -> None:
        self.engine.dispose()


class FaultProxy:
    """An HTTP proxy in front of a collector that injects faults, switchable at any time:
    mode "pass" forwards; "slow" waits `latency` seconds, then forwards; "error" answers
    `status` (503) without forwarding. Counts the requests it saw per mode."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urllib.parse.urlsplit(upstream)
        self.mode = "pass"
        self.latency = 2.0
        self.status = 503
        self.seen: dict[str, int] = {"pass": 0, "slow": 0, "error": 0}
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _forward(self) -> None:
                mode = proxy.mode
                proxy.seen[mode] += 1
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                if mode == "error":
                    payload = b'{"detail":"injected fault"}'
                    self.send_response(proxy.status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                if mode == "slow":
                    time.sleep(proxy.latency)
                upstream = http.client.HTTPConnection(
                    proxy.upstream.hostname, proxy.upstream.port, timeout=60
                )
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(key, value)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                upstream.close()

            do_GET = do_POST = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
