"""Run the collector: in the foreground (`ampwatch serve`) or on a background thread.

The background form serves `ampwatch demo` (which trains in the foreground while the
collector runs beside it) and the tests (a real HTTP server on a free port).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import uvicorn
from pydantic import SecretStr

from ampwatch.server.connections import HeadDeadlineProtocol
from ampwatch.server.main import create_app
from ampwatch.server.metrics import COUNTER_FILE_SUFFIX
from ampwatch.server.migrate import upgrade
from ampwatch.server.settings import Settings

if TYPE_CHECKING:  # typing.Self is Python 3.11+
    from typing_extensions import Self


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening-ready TCP socket; port 0 lets the OS pick a free one.

    Binding before the server starts leaves no window in which another process can take
    the port (`free_port()`-then-bind races under parallel tests).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise RuntimeError(
            f"cannot listen on {host}:{port} ({error.strerror}); is another collector "
            f"running there? Pick another port with --port or AMPWATCH_PORT."
        ) from error
    return sock


def _config(app: Any, settings: Settings, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for `app`: quiet, and idle connections closed
    (`connections.HeadDeadlineProtocol`)."""
    return uvicorn.Config(
        app, log_level="warning", access_log=False, http=HeadDeadlineProtocol,
        timeout_keep_alive=settings.request_head_timeout,  # type: ignore[arg-type]
        **options,
    )  # fmt: skip


def _server(settings: Settings, *, freeze_heap: bool = True) -> uvicorn.Server:
    return uvicorn.Server(_config(create_app(settings, freeze_heap=freeze_heap), settings))


#: What uvicorn imports in each worker process: `create_app()` reads `AMPWATCH_*`.
APP_FACTORY = "ampwatch.server.main:create_app"


def settings_environment(settings: Settings) -> dict[str, str]:
    """`settings` as `AMPWATCH_*` variables, so worker processes rebuild the same Settings."""
    env: dict[str, str] = {}
    for name, value in settings.model_dump().items():
        if value is None:
            continue
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        elif isinstance(value, (list, dict)):
            value = json.dumps(value, default=str)  # networks (webhook_allowed_networks)
        elif isinstance(value, bool):
            value = "true" if value else "false"
        env[f"AMPWATCH_{name.upper()}"] = str(value)
    return env


def serve(settings: Settings) -> None:
    """Apply migrations (unless `settings.migrate` is false), then serve until interrupted.

    `settings.workers` > 1: uvicorn's multi-process mode, one socket shared by the worker
    processes, each building its app with `create_app()` from `AMPWATCH_*` (this process exports
    `settings` there first, with the folder where they keep their ingest counters); the
    supervisor replaces a worker that dies. Several
    collectors on one database must not race migrations: deploy with a one-shot
    `ampwatch db upgrade`, then `ampwatch serve --no-migrate`.
    """
    if settings.migrate:
        upgrade(settings.database_url)
    sock = bind_socket(settings.host, settings.port)
    workers = settings.workers
    if workers == 1:
        _server(settings).run(sockets=[sock])
        return
    from uvicorn.supervisors import Multiprocess

    with _counter_folder(settings) as folder:
        settings = settings.model_copy(update={"metrics_dir": folder})
        os.environ.update(settings_environment(settings))
        config = _config(
            APP_FACTORY, settings, factory=True, workers=workers,
            timeout_worker_healthcheck=WORKER_HEALTHCHECK_TIMEOUT,
        )  # fmt: skip
        Multiprocess(config, sockets=[sock]).run()


#: Seconds the supervisor waits for a worker's answer to its health ping before killing
#: it (uvicorn's default is 5). A worker answers once it has imported the app: on a loaded
#: 2-core machine importing torch alone took longer, and no worker ever became ready.
#: The CLI no longer imports torch (`server/cli`); this covers a slow machine still.
WORKER_HEALTHCHECK_TIMEOUT = 30


@contextmanager
def _counter_folder(settings: Settings) -> Iterator[Path]:
    """Where the workers keep their ingest counters (`metrics.IngestCounters`): the
    configured folder, emptied of an earlier collector's counts, or a temporary one."""
    if settings.metrics_dir is not None:
        settings.metrics_dir.mkdir(parents=True, exist_ok=True)
        for stale in settings.metrics_dir.glob(f"*{COUNTER_FILE_SUFFIX}"):
            stale.unlink()
        yield settings.metrics_dir
        return
    with tempfile.TemporaryDirectory(prefix="ampwatch-metrics-") as folder:
        yield Path(folder)


class BackgroundCollector:
    """A real collector on a daemon thread; a context manager that stops it on exit.

    Pass `sock` (from `bind_socket`) when `settings.port` was chosen by binding it. The
    host process's heap is not frozen (`heap.py`) unless `freeze_heap`: it belongs to the
    host (the demo's trainer, a test session), and collecting it whole at every start cost
    ~0.3 s in a test process that had imported the frameworks.

    >>> with BackgroundCollector(Settings(port=0)) as collector:  # doctest: +SKIP
    ...     print(collector.url)
    """

    def __init__(
        self,
        settings: Settings,
        *,
        sock: socket.socket | None = None,
        start_timeout: float = 30.0,
        freeze_heap: bool = False,
    ) -> None:
        self.settings = settings
        self._sock = sock
        self._start_timeout = start_timeout
        self._server = _server(settings, freeze_heap=freeze_heap)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.settings.public_url

    def start(self) -> Self:
        """Migrate the database, then serve; returns once the server accepts requests."""
        upgrade(self.settings.database_url)
        if self._sock is None:
            self._sock = bind_socket(self.settings.host, self.settings.port)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._sock]},
            name="ampwatch-collector",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the collector did not start on {self.url}")
            time.sleep(0.02)
        return self

    def wait(self) -> None:
        """Block until the server stops (Ctrl-C in the main thread ends the wait)."""
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=0.5)

    def stop(self, timeout: float = 20.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        if self._sock is not None:
            self._sock.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
