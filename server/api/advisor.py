"""`/api/v1/runs/{id}/restart-candidates`: the restart advisor (`ampwatch.server.advisor`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from ampwatch.server.advisor import restart_candidates, run_config
from ampwatch.server.api.deps import RUN_ERRORS, RunIdDep, SessionDep, SessionRoute
from ampwatch.server.schemas.advisor import RestartCandidates
from ampwatch.server.schemas.wire import MAX_STEP

router = APIRouter(
    route_class=SessionRoute, prefix="/runs", tags=["restart advisor"], responses=RUN_ERRORS
)


#: `?margin_steps=`: the advisor's margin, here and in `/resume-plan`.
MarginSteps = Annotated[
    int | None,
    Query(
        ge=0,
        le=MAX_STEP,
        description="Steps a healthy checkpoint must precede the incident onset by "
        "(default: 2% of the run, at least 20).",
    ),
]


@router.get("/{run_id}/restart-candidates")
def get_restart_candidates(
    run_id: RunIdDep,
    session: SessionDep,
    margin_steps: MarginSteps = None,
    min_loss_scale: Annotated[
        float | None,
        Query(
            gt=0,
            allow_inf_nan=False,
            description="Lowest healthy loss scale (default: the run's effective "
            "loss_scale_collapse min_scale, 1.0 unless configured).",
        ),
    ] = None,
) -> RestartCandidates:
    """The run's checkpoints ranked for a restart, each with the reasons for its verdict;
    `recommended` is the latest healthy one (null when none is)."""
    overrides = {} if min_loss_scale is None else {"min_loss_scale": min_loss_scale}
    config = run_config(session, run_id, **overrides)
    return restart_candidates(session, run_id, config=config, margin_steps=margin_steps)
