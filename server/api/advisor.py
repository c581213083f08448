"""`/api/v1/runs/{id}/restart-candidates`: the restart advisor (`ampwatch.server.advisor`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from ampwatch.server.advisor import restart_candidates
from ampwatch.server.api.deps import RUN_ERRORS, RunIdDep, SessionDep, SessionRoute
from ampwatch.server.incident import run_config
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


#: `?healthy_loss_scale=`: the lowest healthy loss scale a checkpoint may have.
HealthyLossScale = Annotated[
    float | None,
    Query(
        gt=0,
        allow_inf_nan=False,
        description="Lowest healthy loss scale (default: the run's effective "
        "loss_scale_collapse min_scale, 1.0 unless configured).",
    ),
]


@router.get("/{run_id}/restart-candidates")
def get_restart_candidates(
    run_id: RunIdDep,
    session: SessionDep,
    margin_steps: MarginSteps = None,
    healthy_loss_scale: HealthyLossScale = None,
    min_loss_scale: Annotated[
        float | None,
        Query(
            gt=0,
            allow_inf_nan=False,
            deprecated=True,
            description="The old name of healthy_loss_scale, still accepted (that one "
            "wins when both are given): `min_loss_scale` is the scaler's floor elsewhere "
            "(watch(), run_start).",
        ),
    ] = None,
) -> RestartCandidates:
    """The run's checkpoints ranked for a restart, each with the reasons for its verdict;
    `recommended` is the latest healthy one (null when none is)."""
    healthy = min_loss_scale if healthy_loss_scale is None else healthy_loss_scale
    overrides = {} if healthy is None else {"healthy_loss_scale": healthy}
    config = run_config(session, run_id, **overrides)
    return restart_candidates(session, run_id, config=config, margin_steps=margin_steps)
