"""The stdlib HTTP transport the agent posts batches with, and the headers of every POST
(`ampwatch upload` posts through `post` too)."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING

from ampwatch.agent import wire

if TYPE_CHECKING:
    from typing_extensions import Self

#: (gzip JSON body, headers) -> HTTP status; raising means "not delivered, retry". A status
#: that is an `Answer` also brings the collector's answer (the sender reads its alerts).
Transport = Callable[[bytes, dict[str, str]], int]


class Answer(int):
    """An HTTP status that carries the response body: still an `int` to every transport
    wrapper that passes the status through, so custom transports keep working."""

    body: bytes

    def __new__(cls, status: int, body: bytes) -> Self:
        answer = super().__new__(cls, status)
        answer.body = body
        return answer


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
    """POST to `url` + `wire.INGEST_PATH`; returns the status (an `Answer`, with the
    collector's answer), raises on connection errors."""
    endpoint = url.rstrip("/") + wire.INGEST_PATH

    def send(body: bytes, headers: dict[str, str]) -> int:
        return Answer(*post(endpoint, body, headers, timeout=timeout))

    return send
