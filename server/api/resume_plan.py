"""`/api/v1/runs/{id}/resume-plan`: the resume plan (`ampwatch.server.resume_plan`)."""

from __future__ import annotations

from fastapi import APIRouter

from ampwatch.server.api.advisor import MarginSteps
from ampwatch.server.api.deps import RUN_ERRORS, RunIdDep, SessionDep, SessionRoute
from ampwatch.server.incident import run_config
from ampwatch.server.resume_plan import resume_plan
from ampwatch.server.schemas.resume_plan import ResumePlan

router = APIRouter(
    route_class=SessionRoute, prefix="/runs", tags=["restart advisor"], responses=RUN_ERRORS
)


@router.get("/{run_id}/resume-plan")
def get_resume_plan(
    run_id: RunIdDep, session: SessionDep, margin_steps: MarginSteps = None
) -> ResumePlan:
    """Where to restart the run from (the advisor's checkpoint and why it is healthy), the
    data to skip (steps, and batches when the run reported its data position) and the
    settings to change (lr, loss scaler, precision), each with its reason. `ready` is
    false, with `why`, when no healthy checkpoint exists."""
    config = run_config(session, run_id)
    return resume_plan(session, run_id, config=config, margin_steps=margin_steps)
