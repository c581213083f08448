"""Local trust (no token, loopback) is for local processes, not for browser pages: a foreign
Origin or Host is refused; a caller that is not on loopback needs a token even where the
configured host says loopback; idle connections are closed."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest
from wire_batches import make_batch, step_record

from ampwatch.agent.wire import INGEST_PATH
from ampwatch.server import auth
from ampwatch.server.db import make_engine, make_sessionmaker
from ampwatch.server.migrate import upgrade
from ampwatch.server.settings import Settings


@pytest.fixture
def open_collector(
    sqlite_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> Iterator[Any]:
    with start_collector(sqlite_url, dashboard=False, request_head_timeout=0.5) as live:
        yield live


def _ingest(live: Any, **headers: str) -> httpx.Response:
    body = json.dumps(make_batch(0, client_run_id="from-a-page", steps=[step_record(1)]))
    return httpx.post(live.url + INGEST_PATH, content=body, headers=headers, timeout=30)


def _runs(live: Any) -> int:
    return int(httpx.get(f"{live.url}/api/v1/runs", timeout=30).json()["total"])


def test_a_cross_origin_text_plain_ingest_is_refused(open_collector: Any) -> None:
    """What a page of another origin sends with fetch(..., {mode: "no-cors"}): a simple
    request, no preflight, and an Origin header the page cannot leave out."""
    answer = _ingest(
        open_collector, **{"Content-Type": "text/plain", "Origin": "http://evil.example"}
    )
    assert answer.status_code == 403 and "another site" in answer.json()["detail"]
    for origin in ("null", "http://localhost:1", open_collector.url.replace("127.0.0.1", "[::1]")):
        assert _ingest(open_collector, Origin=origin).status_code == 403, origin
    assert _runs(open_collector) == 0
    # The collector's own pages (same origin), and local processes (no Origin), may.
    assert _ingest(open_collector, Origin=open_collector.url).status_code == 200
    assert _ingest(open_collector).status_code == 200
    assert _runs(open_collector) == 1


def test_a_foreign_host_is_refused(open_collector: Any) -> None:
    """DNS rebinding: the page's own name, now pointing at 127.0.0.1, is the Host."""
    port = open_collector.url.rsplit(":", 1)[1]
    url = f"{open_collector.url}/api/v1/runs"
    rebound = httpx.get(url, headers={"Host": f"evil.example:{port}"}, timeout=30)
    assert rebound.status_code == 403 and "Host" in rebound.json()["detail"]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert httpx.get(url, headers={"Host": host}, timeout=30).status_code == 200, host
    # Liveness answers whatever the Host (probes use any name).
    probe = httpx.get(f"{open_collector.url}/healthz", headers={"Host": "x"}, timeout=30)
    assert probe.status_code == 200


def test_tokens_mode_is_unaffected_by_origin(
    sqlite_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> None:
    secret = "admin-secret-for-open-mode"
    with start_collector(sqlite_url, dashboard=False, auth="token", admin_token=secret) as live:
        answer = _ingest(live, Origin="http://evil.example", Authorization=f"Bearer {secret}")
    assert answer.status_code == 200


def test_local_trust_needs_a_loopback_caller(sqlite_url: str) -> None:
    """`uvicorn --factory ... --host 0.0.0.0` leaves Settings.host at 127.0.0.1: the
    caller's address decides, so a remote caller needs a token."""
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    settings = Settings(database_url=sqlite_url)
    with make_sessionmaker(engine)() as session:
        assert auth.resolve_principal(session, settings, None, peer="127.0.0.1").is_admin
        assert auth.resolve_principal(session, settings, None, peer="::1").is_admin
        for remote in ("10.1.2.3", "192.0.2.7", "2001:db8::1"):
            with pytest.raises(auth.AuthError) as refused:
                auth.resolve_principal(session, settings, None, peer=remote)
            assert refused.value.status == 401
    engine.dispose()


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_idle_and_trickling_connections_are_closed(open_collector: Any) -> None:
    host, port = open_collector.url.removeprefix("http://").rsplit(":", 1)
    silent = socket.create_connection((host, int(port)))
    started = time.monotonic()
    assert _closed_within(silent, 5.0)
    assert time.monotonic() - started < 3.0
    silent.close()

    trickle = socket.create_connection((host, int(port)))
    trickle.sendall(b"GET /api/v1/runs HTTP/1.1\r\n")
    started = time.monotonic()
    closed = False
    for _ in range(40):  # a header byte every 0.1 s: each resets uvicorn's own idle timer
        try:
            trickle.sendall(b"X")
        except OSError:
            closed = True
            break
        time.sleep(0.1)
    assert closed or _closed_within(trickle, 0.1)
    assert time.monotonic() - started < 3.0
    trickle.close()

    # A normal request is answered, then the idle connection is closed.
    kept = socket.create_connection((host, int(port)))
    kept.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    assert kept.recv(65536).startswith(b"HTTP/1.1 200")
    assert _closed_within(kept, 5.0)
    kept.close()
