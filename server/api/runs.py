"""`/api/v1/runs`: what the dashboard and the CLI read."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, Response
from sqlalchemy.orm import Session

from ampwatch.agent.wire import MAX_NAME_LENGTH
from ampwatch.server import lifecycle, queries
from ampwatch.server.api import conditional
from ampwatch.server.api.deps import (
    NOT_YOURS,
    RUN_ERRORS,
    PrincipalDep,
    RunIdDep,
    RunReadDep,
    SessionDep,
    SessionRoute,
)
from ampwatch.server.auth import project_for_new_data
from ampwatch.server.models import Health, RunStatus
from ampwatch.server.schemas.runs import RunCreate, RunEnd, RunPublic, RunsPublic
from ampwatch.server.schemas.wire import MAX_INT

router = APIRouter(route_class=SessionRoute, prefix="/runs", tags=["runs"])

DEFAULT_PAGE = 100
MAX_PAGE = 1000


@router.get("", response_model=RunsPublic, responses=NOT_YOURS)
def list_runs(
    request: Request,
    session: SessionDep,
    principal: PrincipalDep,
    project: Annotated[
        str | None, Query(description="Only this project's runs (a project token: its own).")
    ] = None,
    status: Annotated[RunStatus | None, Query(description="running or ended.")] = None,
    health: Annotated[
        Health | None, Query(description="ok, warning or critical (worst firing alert).")
    ] = None,
    q: Annotated[
        str | None, Query(max_length=MAX_NAME_LENGTH, description="Text the run name contains.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description="Page size.")] = DEFAULT_PAGE,
    offset: Annotated[int, Query(ge=0, le=MAX_INT, description="Runs to skip.")] = 0,
) -> Response:
    """Runs newest first, filtered, one page at a time (limit/offset, with the total).

    Offset paging, not cursors: a runs list is short (thousands of rows), and people jump
    to page N. A project token lists only its project's runs. The answer is tagged with
    its digest: a poll of an unchanged list is a 304 with no body (`conditional`).
    """
    if project is not None:
        principal.check_project(project)
    page = queries.list_runs(
        session,
        project=principal.project or project,
        status=status,
        health=health,
        name_contains=q,
        limit=limit,
        offset=offset,
    )
    return conditional.digest_tag(request, page.model_dump_json().encode())


@router.post(
    "",
    status_code=201,
    responses={200: {"model": RunPublic, "description": "An existing run, resumed"}, **NOT_YOURS},
)
def create_run(
    body: RunCreate,
    response: Response,
    session: SessionDep,
    principal: PrincipalDep,
) -> RunPublic:
    """Create a run (201), or resume the project's run with this client_run_id (200):
    idempotent. Client run ids are per project: another project's run of the same id is
    another run."""
    project = project_for_new_data(principal, body.project)
    run_id, created = lifecycle.create_or_resume(
        session, client_run_id=body.client_run_id, name=body.name, project=project
    )
    response.status_code = 201 if created else 200
    return _read_run(session, run_id)


@router.get("/{run_id}", responses=RUN_ERRORS)
def get_run(run_id: RunReadDep, session: SessionDep) -> RunPublic:
    return _read_run(session, run_id)


@router.post("/{run_id}/end", responses=RUN_ERRORS)
def end_run(run_id: RunIdDep, session: SessionDep, body: RunEnd | None = None) -> RunPublic:
    """Mark the run ended (idempotent: ending an ended run changes nothing)."""
    if not lifecycle.end_run(session, run_id, reason=body.reason if body else None):
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return _read_run(session, run_id)


@router.delete("/{run_id}", status_code=204, responses=RUN_ERRORS)
def delete_run(run_id: RunIdDep, session: SessionDep) -> Response:
    """Delete the run and all its data (steps, layers, histograms, events) at once."""
    if not lifecycle.delete_run(session, run_id):
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return Response(status_code=204)


def _read_run(session: Session, run_id: int) -> RunPublic:
    run = queries.get_run(session, run_id)
    if run is None:  # deleted between the existence check and this read
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return run


# A run's data (steps, layers, histograms, events, checkpoints): `run_data.py`.
