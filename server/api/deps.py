"""Dependencies shared by the routers, as `Annotated` aliases (`SessionDep`, ...)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import datetime
from typing import Annotated, Any, TypeVar, cast

from fastapi import Depends, HTTPException, Request, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Connection, Row, bindparam, select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from ampwatch.server.api import conditional
from ampwatch.server.auth import (
    ACCESS_EXTRA,
    Principal,
    required_access,
    resolve_principal,
)
from ampwatch.server.errors import StrictJSONRequest
from ampwatch.server.models import Run
from ampwatch.server.schemas.errors import ErrorPublic
from ampwatch.server.schemas.wire import MAX_INT
from ampwatch.server.settings import Settings


async def get_settings(request: Request) -> Settings:
    """(Async: FastAPI runs a sync dependency on a worker thread, a hop per request.)"""
    return cast(Settings, request.app.state.settings)


async def get_session(request: Request) -> AsyncIterator[Session]:
    """One session per request, closed (and any open transaction rolled back) after it.

    Async: made on the event loop (a session opens no connection before its first
    statement), so a request pays no worker-thread hop to make it and none to leave it
    (FastAPI runs a sync generator's entry and its exit each on a thread). Routes of
    `SessionRoute` close it on the endpoint's thread as soon as it returns; this exit is
    the backstop for any other route, and closes a session still in a transaction on a
    worker thread (its rollback may wait for the database).
    """
    session = cast(Session, request.app.state.sessionmaker())
    try:
        yield session
    finally:
        if session.in_transaction():
            await run_in_threadpool(session.close)
        else:
            session.close()


def _closing_sessions(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(endpoint):
        return endpoint

    @functools.wraps(endpoint)  # FastAPI reads the signature through __wrapped__
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return endpoint(*args, **kwargs)
        finally:
            for value in kwargs.values():
                if isinstance(value, Session):
                    value.close()

    return call


class SessionRoute(APIRoute):
    """A route whose endpoint's `SessionDep` is closed, its connection back in the pool,
    on the worker thread that ran the endpoint, as soon as it returns.

    Why: FastAPI exits a dependency with `yield` only after validating the response, and
    for a sync endpoint that validation waits for a free worker thread of its own. Under
    ~200 concurrent requests every thread waited for a pooled connection that was held by
    a finished request waiting for a thread: the whole collector, `/healthz` included,
    froze until the pool's 30 s timeout answered 500s. Closed here, a connection is only
    ever held by a running thread, so the pool always drains. Every router under `api/`
    uses this class (`APIRouter(route_class=SessionRoute)`); endpoints return finished
    pydantic models, never ORM objects that would load after the close. Its JSON bodies
    are parsed strictly (`errors.StrictJSONRequest`).

    Every route of this class has a caller (`main.create_app` guards each router with
    `get_principal`), and the caller is resolved before the body is read: FastAPI reads a
    JSON body whole before it runs any dependency, so a 50 MB body from a caller without a
    token was read and parsed (+667 MiB, 5 s) before the 401. The size of a body is
    bounded for every route (`body_limit.BodyLimit`).
    """

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, _closing_sessions(endpoint), **kwargs)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """The caller first (`resolve_caller`), then the body, read as strict JSON
        (`errors.StrictJSONRequest`: NaN is a 422)."""
        handler = super().get_route_handler()

        async def caller_first(request: Request) -> Response:
            request.scope[_PRINCIPAL_KEY] = await run_in_threadpool(resolve_caller, request)
            try:
                response = await handler(StrictJSONRequest(request.scope, request.receive))
            except conditional.NotModified as unchanged:  # from `RunReadDep`
                return conditional.not_modified(unchanged)
            except conditional.Kept as kept:  # from `RunReadDep`
                return conditional.kept_response(kept)
            return conditional.tag_response(request, response)

        return caller_first


SettingsDep = Annotated[Settings, Depends(get_settings)]

#: OpenAPI error answers of every authenticated route (`responses=` of a route or router).
AUTH_ERRORS: dict[int | str, dict[str, Any]] = {
    # FastAPI answers 400 when a JSON body cannot be read at all (bytes that are not text).
    400: {"model": ErrorPublic, "description": "A request body that cannot be read"},
    401: {"model": ErrorPublic, "description": "No token, or an unknown or revoked one"},
}
NOT_YOURS: dict[int | str, dict[str, Any]] = {
    403: {"model": ErrorPublic, "description": "The token's project may not access this"},
}
RUN_ERRORS: dict[int | str, dict[str, Any]] = {
    **NOT_YOURS,
    404: {"model": ErrorPublic, "description": "No such run"},
}
SessionDep = Annotated[Session, Depends(get_session)]


#: Declares the bearer scheme in OpenAPI ("Authorize" in /docs); `get_principal` reads the
#: header itself, because a malformed header must be a 401, not "no header".
_bearer = HTTPBearer(auto_error=False, description="A project token or the admin token.")


#: Where `SessionRoute` leaves the caller it resolved, for `get_principal`.
_PRINCIPAL_KEY = "ampwatch.principal"


def resolve_caller(request: Request) -> Principal:
    """Who is calling (401 when no valid token and none is needed: `ampwatch.server.auth`;
    403 when the token's scope does not cover the route: `auth.required_access`).

    Uses a connection of its own (`db.lookup_connections`: reads only; autocommit on
    PostgreSQL), closed before the endpoint runs, so that an endpoint that writes starts
    its transaction fresh (SQLite: as a writer, `db.begin_write`).
    """
    settings = cast(Settings, request.app.state.settings)
    declared = (getattr(request.scope["route"], "openapi_extra", None) or {}).get(ACCESS_EXTRA)
    access = required_access(request.method, declared)
    with request.app.state.lookup_connections() as connection:
        peer = request.client.host if request.client else None
        authorization = request.headers.get("authorization")
        principal = resolve_principal(connection, settings, authorization, access=access, peer=peer)
        run_id = request.path_params.get("run_id")
        if isinstance(run_id, str) and run_id.isdecimal():  # else FastAPI answers 422
            request.scope[_RUN_KEY] = _run_row(connection, int(run_id))
        read = getattr(request.scope["route"].endpoint, _CALLER_READ, None)
        if read is not None:
            request.scope[_CALLER_READ] = read(connection, request, principal)
        return principal


E = TypeVar("E", bound=Callable[..., Any])
#: The endpoint attribute `reads_with_caller` sets, and the request scope key of its value.
_CALLER_READ = "ampwatch_caller_read"


def reads_with_caller(read: Callable[[Connection, Request, Principal], Any]) -> Callable[[E], E]:
    """Mark an endpoint whose dependencies need `read(connection, request, caller)` before
    its own session opens: `resolve_caller` runs it in its hop and lookup connection, and
    `caller_read` gives the value. Why: a dependency that answers a kept page (`Kept`)
    before the endpoint's `SessionDep` saves that session and its worker-thread hop, as
    `RunReadDep` does with the run row the caller's hop reads."""

    def mark(endpoint: E) -> E:
        setattr(endpoint, _CALLER_READ, read)  # functools.wraps carries it to the route's
        return endpoint

    return mark


def caller_read(request: Request) -> Any:
    """What the endpoint's `reads_with_caller` read in the caller's hop (None: nothing)."""
    return request.scope.get(_CALLER_READ)


async def get_principal(
    request: Request,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The caller `SessionRoute` resolved before reading the body (`resolve_caller`), or
    resolved now on a route of another class."""
    principal = request.scope.get(_PRINCIPAL_KEY)
    if isinstance(principal, Principal):
        return principal
    return await run_in_threadpool(resolve_caller, request)


PrincipalDep = Annotated[Principal, Depends(get_principal)]


#: Where `resolve_caller` leaves the path's run (`_run_row`), read in the caller's hop.
_RUN_KEY = "ampwatch.path_run"
_RUNS = Run.__table__.c  # table columns, not the ORM's: as `auth._TOKEN_BY_PREFIX`
_RUN_ROW = select(_RUNS.project, _RUNS.created_at, _RUNS.version, _RUNS.alerts_version).where(
    _RUNS.id == bindparam("run_id")
)


def _run_row(connection: Connection, run_id: int) -> Row[str, datetime, int, int] | None:
    """The run's (project, created_at, version, alerts_version); None when there is no such
    run (ids beyond INTEGER included)."""
    if not 1 <= run_id <= MAX_INT:
        return None
    return connection.execute(_RUN_ROW, {"run_id": run_id}).first()


def _own_run_row(request: Request, run_id: int) -> Row[str, datetime, int, int] | None:
    with request.app.state.lookup_connections() as connection:
        return _run_row(connection, run_id)


async def existing_run_id(run_id: int, request: Request, principal: PrincipalDep) -> int:
    """The path's run id: 404 when no such run exists, 403 when it belongs to a project
    the caller's token is not for. Its change counter comes with it, for `RunReadDep`.

    Async, with the run read in the caller's hop (`resolve_caller`): FastAPI runs a sync
    dependency on a worker thread, and under load each hop waits for the GIL."""
    if _RUN_KEY in request.scope:
        row = request.scope[_RUN_KEY]
    else:  # an id pydantic reads and `str.isdecimal` does not ("+5", " 5", "5.0")
        row = await run_in_threadpool(_own_run_row, request, run_id)
    if row is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    principal.check_project(row.project)
    request.scope[conditional.RUN_VERSION_KEY] = (row.created_at, row.version, row.alerts_version)
    return run_id


RunIdDep = Annotated[int, Depends(existing_run_id)]


async def unchanged_run(run_id: RunIdDep, request: Request) -> int:
    """The path's run id, as `RunIdDep`; a 304 when the caller holds the answer's tag
    (`conditional.check_run`), else the answer carries it."""
    conditional.check_run(request, run_id)
    return run_id


#: The run id of a route whose answer changes only with the run's change counter
#: (`ampwatch.server.run_version`): tagged, and a 304 when unchanged (`conditional`).
RunReadDep = Annotated[int, Depends(unchanged_run)]


async def unchanged_run_alerts(run_id: RunIdDep, request: Request) -> int:
    """As `unchanged_run`, by the run's alerts counter: a batch that writes no alert leaves
    the run's alerts page as it was."""
    conditional.check_run(request, run_id, alerts=True)
    return run_id


#: The run id of the run's alerts page: tagged by its alerts counter.
RunAlertsReadDep = Annotated[int, Depends(unchanged_run_alerts)]
