"""`/api/v1/runs/{id}/resume-plan`: the resume plan (`ampwatch.server.resume_plan`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from ampwatch.server.advisor import run_config
from ampwatch.server.api.deps import RUN_ERRORS, RunIdDep, SessionDep, SessionRoute
from ampwatch.server.resume_plan import resume_plan
from ampwatch.server.schemas.resume_plan import ResumePlan
from ampwatch.server.schemas.wire import MAX_STEP

router = APIRouter(
    route_class=SessionRoute, prefix="/runs", tags=["restart advisor"], responses=RUN_ERRORS
)


@router.get("/{run_id}/resume-plan")
def get_resume_plan(
    run_id: RunIdDep,
    session: SessionDep,
    margin_steps: Annotated[
        int | None,
        Query(
            ge=0,
            le=MAX_STEP,
            description="Steps a healthy checkpoint must precede the incident onset by "
            "(default: 2% of the run, at least 20).",
        ),
    ] = None,
) -> ResumePlan:
    """Where to restart the run from (the advisor's checkpoint and why it is healthy), the
    data to skip (steps, and batches when the run reported its data position) and the
    settings to change (lr, loss scaler, precision), each with its reason. `ready` is
    false, with `why`, when no healthy checkpoint exists."""
    return resume_plan(
        session, run_id, config=run_config(session, run_id), margin_steps=margin_steps
    )
