"""A real HTTP webhook receiver for tests: stdlib `http.server` on a thread.

Each POST is recorded (path, parsed JSON body). What a path answers is scripted:
`receiver.script("/flaky", [500, 500, 200])` answers those statuses in turn (the last one
from then on); `receiver.delay("/slow", 2.0)` sleeps before answering.

>>> with WebhookReceiver() as receiver:  # doctest: +SKIP
...     url = receiver.url("/hook")
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # typing.Self is Python 3.11+
    from typing_extensions import Self


class WebhookReceiver:
    def __init__(self) -> None:
        self.requests: list[tuple[str, Any]] = []
        self._statuses: dict[str, list[int]] = {}
        self._delays: dict[str, float] = {}
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status = receiver._answer(self.path, body)
                delay = receiver._delays.get(self.path, 0.0)
                if delay:
                    time.sleep(delay)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok" if status < 400 else b"no")
                except OSError:  # the client gave up (timeout) before the answer
                    pass

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _answer(self, path: str, body: bytes) -> int:
        with self._lock:
            try:
                parsed: Any = json.loads(body)
            except ValueError:
                parsed = body.decode(errors="replace")
            self.requests.append((path, parsed))
            statuses = self._statuses.get(path, [200])
            return statuses.pop(0) if len(statuses) > 1 else statuses[0]

    def url(self, path: str) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}{path}"

    def script(self, path: str, statuses: list[int]) -> None:
        self._statuses[path] = list(statuses)

    def delay(self, path: str, seconds: float) -> None:
        self._delays[path] = seconds

    def bodies(self, path: str) -> list[Any]:
        with self._lock:
            return [body for p, body in self.requests if p == path]

    def wait_for(self, path: str, count: int, timeout: float = 10.0) -> list[Any]:
        """The bodies POSTed to `path` once there are at least `count` (or fail)."""
        deadline = time.monotonic() + timeout
        while len(self.bodies(path)) < count:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{path} received {len(self.bodies(path))} POSTs, expected {count}"
                )
            time.sleep(0.02)
        return self.bodies(path)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
