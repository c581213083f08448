"""Dependencies shared by the routers, as `Annotated` aliases (`SessionDep`, ...)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, cast

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from ampwatch.server.auth import (
    ACCESS_EXTRA,
    Principal,
    required_access,
    resolve_principal,
    run_project,
)
from ampwatch.server.schemas import MAX_INT, ErrorPublic
from ampwatch.server.settings import Settings


def get_settings(request: Request) -> Settings:
    return cast(Settings, request.app.state.settings)


def get_session(request: Request) -> Iterator[Session]:
    """One session per request, closed (and any open transaction rolled back) after it."""
    with request.app.state.sessionmaker() as session:
        yield session


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


def get_principal(
    request: Request,
    settings: SettingsDep,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """Who is calling (401 when no valid token and none is needed: `ampwatch.server.auth`;
    403 when the token's scope does not cover the route: `auth.required_access`).

    Uses a session of its own, closed before the endpoint runs, so that an endpoint that
    writes starts its transaction fresh (SQLite: as a writer, `db.begin_write`).
    """
    declared = (getattr(request.scope["route"], "openapi_extra", None) or {}).get(ACCESS_EXTRA)
    access = required_access(request.method, declared)
    with request.app.state.sessionmaker() as session:
        return resolve_principal(
            session, settings, request.headers.get("authorization"), access=access
        )


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def existing_run_id(run_id: int, request: Request, principal: PrincipalDep) -> int:
    """The path's run id: 404 when no such run exists (ids beyond INTEGER included), 403
    when it belongs to a project the caller's token is not for."""
    project = None
    if 1 <= run_id <= MAX_INT:
        with request.app.state.sessionmaker() as session:
            project = run_project(session, run_id)
    if project is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    principal.check_project(project)
    return run_id


RunIdDep = Annotated[int, Depends(existing_run_id)]
