"""`/api/v1/runs`: what the dashboard and the CLI read."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query

from ampwatch.agent.wire import LAYER_STATS
from ampwatch.server import queries
from ampwatch.server.api.deps import RunIdDep, SessionDep
from ampwatch.server.schemas import (
    MAX_INT,
    EventsPublic,
    LayerMatrix,
    RunPublic,
    RunsPublic,
    StepSeries,
)

router = APIRouter(prefix="/runs", tags=["runs"])

RankQuery = Annotated[int, Query(ge=0, le=MAX_INT, description="Data-parallel rank.")]


@router.get("")
def list_runs(session: SessionDep) -> RunsPublic:
    """Every run, newest first."""
    return queries.list_runs(session)


@router.get("/{run_id}")
def get_run(run_id: RunIdDep, session: SessionDep) -> RunPublic:
    run = queries.get_run(session, run_id)
    if run is None:  # deleted between the existence check and this read
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return run


@router.get("/{run_id}/steps")
def get_steps(run_id: RunIdDep, session: SessionDep, rank: RankQuery = 0) -> StepSeries:
    """One rank's steps as columns ordered by step."""
    return queries.step_series(session, run_id, rank)


@router.get("/{run_id}/layers")
def get_layers(
    run_id: RunIdDep,
    session: SessionDep,
    stat: Annotated[str, Query(description=f"One of {', '.join(LAYER_STATS)}.")] = LAYER_STATS[0],
    rank: RankQuery = 0,
) -> LayerMatrix:
    """One per-layer statistic as a steps x layers matrix."""
    if stat not in LAYER_STATS:
        raise HTTPException(
            status_code=422, detail=f"unknown statistic {stat!r}; expected one of {LAYER_STATS}"
        )
    return queries.layer_matrix(session, run_id, stat, rank)


@router.get("/{run_id}/events")
def get_events(run_id: RunIdDep, session: SessionDep) -> EventsPublic:
    """A run's events in time order."""
    return queries.run_events(session, run_id)
