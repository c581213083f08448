"""The stdlib HTTP transport the agent posts batches with, and the headers of every POST
(`ampwatch upload` posts through `post` too)."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable

from ampwatch.agent import wire

#: (gzip JSON body, headers) -> HTTP status; raising means "not delivered, retry".
Transport = Callable[[bytes, dict[str, str]], int]

HEADERS = {"Content-Type": "application/json", "Content-Encoding": "gzip"}


def request_headers(token: str | None) -> dict[str, str]:
    """Headers of every ingest POST; a token is sent as `Authorization: Bearer <token>`."""
    return {**HEADERS, "Authorization": f"Bearer {token}"} if token else dict(HEADERS)


def post(url: str, body: bytes, headers: dict[str, str], *, timeout: float) -> tuple[int, bytes]:
    """POST `body` to `url` with the standard library: (status, response body), any status."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


def http_transport(url: str, *, timeout: float = 10.0) -> Transport:
    """POST to `url` + `wire.INGEST_PATH`; returns the status, raises on connection errors."""
    endpoint = url.rstrip("/") + wire.INGEST_PATH

    def send(body: bytes, headers: dict[str, str]) -> int:
        return post(endpoint, body, headers, timeout=timeout)[0]

    return send
