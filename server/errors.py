"""Bad input is a 4xx that says what is wrong, never a 5xx: one validation-error answer,
strict JSON bodies, and no NUL bytes in paths or query strings.

What a probe found answering 500: a bare `NaN`, `Infinity` or `1e999` in a JSON body
(FastAPI's default 422 handler echoes the offending input, and the JSON renderer refuses
NaN), and a NUL byte in a path or query parameter (PostgreSQL text rejects it). Here:

- `validation_detail` renders validation errors as location, message and type only,
  never the input (which may be anything, a NaN or a megabyte of it), at most
  `MAX_REPORTED_ERRORS` of them;
- no answer quotes more than a short, escaped prefix of what was sent (`clip`,
  `bounded_message`): a 4 MB string as an unknown key, an unknown event kind, a
  layer-statistic slot or an alert rule's name came back whole in a 422's location or
  message (a ~1,000x amplification for a gzip body). Messages name the caller's values with
  `repr` (`unknown rule 'x'`): every quoted span longer than `MAX_QUOTED` characters is
  cut to that, and a message to `MAX_MESSAGE` in all, in the validation answer, in every
  `HTTPException`'s detail (`http_error`) and in the middlewares' refusals;
- `StrictJSONRequest` parses bodies with orjson, which refuses NaN/Infinity literals,
  numbers that overflow a double and nesting deeper than 1,024, as "JSON decode error"
  422s (the ingest route reads its body by hand, `api.ingest`);
- `RejectNul` answers 400 to a NUL byte in the path or query string before any route;
- `database_busy`: a database that is busy (SQLite's write lock past its busy timeout) or
  unreachable is a 503 with Retry-After, which agents retry, not a 500.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

#: A batch with thousands of bad values would otherwise answer with thousands of errors.
MAX_REPORTED_ERRORS = 20
#: The most characters of one value of the caller's an answer quotes (a location part, a
#: quoted span of a message).
MAX_QUOTED = 64
#: The most characters of one message (the longest honest one lists the ~2,400 characters
#: of the layer statistics' names).
MAX_MESSAGE = 4096
#: A span a message quotes with `repr`: '...' or "..." (escapes kept), not an apostrophe.
_QUOTED = re.compile(r"""(?<!\w)(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")""")


def clip(text: str, limit: int = MAX_QUOTED) -> str:
    """At most `limit` characters of `text`, control and non-ASCII characters escaped, and
    how long it was when it was longer.

    >>> clip("zero_fraction"), clip("x" * 100, 4)
    ('zero_fraction', 'xxxx… (100 characters)')
    """
    head = text[:limit].encode("unicode_escape").decode("ascii")[:limit]
    return head if len(text) <= limit else f"{head}… ({len(text)} characters)"


def bounded_message(text: str) -> str:
    """`text` with every quoted span cut to `MAX_QUOTED` characters (`clip`), then to
    `MAX_MESSAGE` characters in all.

    >>> bounded_message("unknown rule '" + "z" * 1000 + "'")
    "unknown rule 'zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz… (1000 characters)'"
    """

    def cut(quoted: re.Match[str]) -> str:
        span = quoted.group(0)
        if len(span) <= MAX_QUOTED + 2:
            return span
        return f"{span[0]}{clip(span[1:-1])}{span[0]}"

    text = _QUOTED.sub(cut, text)
    return text if len(text) <= MAX_MESSAGE else f"{text[:MAX_MESSAGE]}…"


def validation_detail(errors: Sequence[Any]) -> list[dict[str, Any]]:
    """Pydantic/FastAPI errors as `{loc, msg, type}` dicts, at most MAX_REPORTED_ERRORS
    (then one saying how many were left out): always renderable as strict JSON, quoting
    no more than `clip` and `bounded_message` allow."""
    details = [
        {
            "loc": [
                part if isinstance(part, int) else clip(str(part)) for part in error.get("loc", ())
            ],
            "msg": bounded_message(str(error.get("msg", ""))),
            "type": clip(str(error.get("type", ""))),
        }
        for error in errors[:MAX_REPORTED_ERRORS]
    ]
    if len(errors) > MAX_REPORTED_ERRORS:
        omitted = len(errors) - MAX_REPORTED_ERRORS
        details.append({"loc": [], "msg": f"{omitted} more errors omitted", "type": "omitted"})
    return details


async def validation_error(_request: Request, error: Exception) -> JSONResponse:
    """The app's RequestValidationError handler (`main.create_app`)."""
    assert isinstance(error, RequestValidationError)
    return JSONResponse({"detail": validation_detail(error.errors())}, status_code=422)


async def http_error(_request: Request, error: Exception) -> JSONResponse:
    """The app's HTTPException handler: starlette's, with a message bounded
    (`bounded_message`; a list detail comes from `validation_detail`)."""
    assert isinstance(error, HTTPException)
    detail = error.detail
    if isinstance(detail, str):
        detail = bounded_message(detail)
    return JSONResponse({"detail": detail}, status_code=error.status_code, headers=error.headers)


#: The 503 of a busy or unreachable database (`database_busy`, the ingest process's).
DATABASE_BUSY = "the database is busy or unreachable; retry shortly"
RETRY_AFTER = {"Retry-After": "1"}


async def database_busy(_request: Request, _error: Exception) -> JSONResponse:
    """The app's handler for sqlalchemy's OperationalError and pool TimeoutError."""
    return JSONResponse({"detail": DATABASE_BUSY}, status_code=503, headers=RETRY_AFTER)


class StrictJSONRequest(Request):
    """A request whose JSON body is parsed by orjson: NaN, Infinity, 1e999 and absurd
    nesting are invalid JSON (orjson's errors are `json.JSONDecodeError`s, which FastAPI
    answers with a 422 "JSON decode error"). Used by `api.deps.SessionRoute`."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = orjson.loads(body)
            except orjson.JSONDecodeError as error:
                raise json.JSONDecodeError(
                    str(error), body.decode(errors="replace"), error.pos
                ) from error
        return self._json


class RejectNul:
    """ASGI middleware: 400 for a NUL byte (raw or %00) in the path or query string."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            query: bytes = scope.get("query_string", b"")
            if "\x00" in scope.get("path", "") or b"\x00" in query or b"%00" in query:
                answer = JSONResponse(
                    {"detail": "NUL bytes are not allowed in paths or query parameters"},
                    status_code=400,
                )
                await answer(scope, receive, send)
                return
        await self.app(scope, receive, send)
