"""Dependencies shared by the routers, as `Annotated` aliases (`SessionDep`, ...)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, cast

from fastapi import Depends, HTTPException, Request
from sqlalchemy.orm import Session

from ampwatch.server import queries
from ampwatch.server.schemas import MAX_INT
from ampwatch.server.settings import Settings


def get_settings(request: Request) -> Settings:
    return cast(Settings, request.app.state.settings)


def get_session(request: Request) -> Iterator[Session]:
    """One session per request, closed (and any open transaction rolled back) after it."""
    with request.app.state.sessionmaker() as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]


def existing_run_id(run_id: int, session: SessionDep) -> int:
    """The path's run id, or 404 when no such run exists (ids beyond INTEGER included)."""
    if not 1 <= run_id <= MAX_INT or not queries.run_exists(session, run_id):
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return run_id


RunIdDep = Annotated[int, Depends(existing_run_id)]
