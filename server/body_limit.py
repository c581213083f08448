"""Every request body at most `AMPWATCH_MAX_BODY_BYTES`, whatever the route and the caller:
a declared `Content-Length` above it is a 413 before a byte is read, and a body sent without
one (chunked) is a 413 as soon as the bytes read pass it. An answer sent before the body
was read to its end (a 413, a 401) closes the connection, so the server does not read and
drop the rest of it either.

Why at the ASGI level: FastAPI reads a route's JSON body whole before any dependency runs,
so a per-route check, or the token check of `api.deps.get_principal`, came after the
damage. An unauthenticated 50 MB `POST /api/v1/runs` cost the collector +667 MiB and 5 s
(issue 26). Together with `api.deps.SessionRoute`, which resolves the caller before the
route reads its body, an unauthenticated or oversized request is answered without its body
being buffered. The ingest route also bounds what a gzip body inflates to
(`ingest_worker.decoded_body`).
"""

from __future__ import annotations

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a body passes the limit: FastAPI passes an HTTPException
    raised while it reads a body on to the app's handler (a 413), and `BodyLimit` answers
    it itself for anything else (the mounted dashboard)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            status_code=413,
            detail=f"request body larger than {limit} bytes (AMPWATCH_MAX_BODY_BYTES); "
            "send smaller batches",
        )


class BodyLimit:
    """ASGI middleware; add it inside `metrics.CountRejections` (`main.create_app`), so
    that an ingest request refused here is counted."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        unread = False  # a body is on its way and not read to its end yet
        for name, value in scope["headers"]:
            if name == b"content-length":
                # The server has checked the header's syntax (h11, httptools): digits only.
                if value.isdigit() and int(value) > limit:
                    await _refuse(BodyTooLarge(limit), scope, receive, send)
                    return
                unread = unread or value.strip(b"0") != b""
            elif name == b"transfer-encoding":
                unread = True
        received = 0
        started = False

        async def bounded_receive() -> Message:
            nonlocal received, unread
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
                unread = unread and message.get("more_body", False)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if unread:  # answered without the body (a 401, say): not worth draining
                    message["headers"] = [*message.get("headers", ()), _CLOSE]
            await send(message)

        try:
            await self.app(scope, bounded_receive, watched_send)
        except BodyTooLarge as error:
            if started:
                raise
            await _refuse(error, scope, receive, send)


_CLOSE = (b"connection", b"close")


async def _refuse(error: BodyTooLarge, scope: Scope, receive: Receive, send: Send) -> None:
    # The connection is closed: the rest of the body is not worth reading to keep it open.
    answer = JSONResponse(
        {"detail": error.detail}, status_code=error.status_code, headers={"Connection": "close"}
    )
    await answer(scope, receive, send)
