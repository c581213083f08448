"""`/api/v1/runs/{id}/...`: a run's data -- steps, layer statistics, histograms, events.

Every series is downsampled on the server (`ampwatch.server.series`, min/max per bucket),
so a 100k-step run answers in a browser-sized payload by default; `start`/`end` zoom in
and `max_points` trades detail for size. All parameters are optional: callers of the
first API (`/steps`, `/layers?stat=`) keep working and get the downsampled answer only
for runs longer than the defaults.
"""

from __future__ import annotations

from typing import Annotated

import orjson
from fastapi import APIRouter, HTTPException, Query, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from sqlalchemy.orm import Session

from ampwatch.agent.wire import ACTIVATION_STATS, LAYER_STATS, PARAMETER_STATS
from ampwatch.server import full_layers, history, layer_reads, queries, rollback, series
from ampwatch.server.api.deps import RUN_ERRORS, RunIdDep, RunReadDep, SessionDep, SessionRoute
from ampwatch.server.rule_lines import rule_lines
from ampwatch.server.schemas.runs import (
    AbandonedTails,
    CheckpointsPublic,
    EventsPublic,
    FullLayers,
    LayerHistograms,
    LayerMatrix,
    LayerSeries,
    StepSeries,
)
from ampwatch.server.schemas.wire import MAX_BIGINT, MAX_INT

router = APIRouter(
    route_class=SessionRoute, prefix="/runs", tags=["run data"], responses=RUN_ERRORS
)

#: Defaults sized for a chart ~1,000 px wide: two points (min, max) per pixel column.
DEFAULT_MAX_POINTS = 2000
DEFAULT_HEATMAP_STEPS = 500
DEFAULT_HEATMAP_LAYERS = 500
DEFAULT_HISTOGRAMS = 200
#: An explicit limit, so that no request can ask for an unbounded answer by accident.
MAX_POINTS_LIMIT = 1_000_000

RankQuery = Annotated[int, Query(ge=0, le=MAX_INT, description="Data-parallel rank.")]
StartQuery = Annotated[
    int | None, Query(ge=0, le=MAX_BIGINT, description="First step (inclusive).")
]
EndQuery = Annotated[int | None, Query(ge=0, le=MAX_BIGINT, description="Last step (inclusive).")]
#: Parameter statistics (columns: the run's layers) and activation statistics (columns:
#: its leaf modules) share the layer-statistic endpoints.
STATS = (*PARAMETER_STATS, *ACTIVATION_STATS)
StatQuery = Annotated[str, Query(description=f"One of {', '.join(STATS)}.")]
MaxPointsQuery = Annotated[
    int, Query(ge=2, le=MAX_POINTS_LIMIT, description="Most points returned.")
]


def _json(answer: BaseModel) -> Response:
    """The answer written by orjson, skipping FastAPI's re-validation of the return value
    (the response model stays declared on the route, for OpenAPI); a nested model (a step
    series' `rule_lines`) is dumped as pydantic would."""
    return Response(
        orjson.dumps(dict(answer), default=BaseModel.model_dump), media_type="application/json"
    )


def _known_stat(stat: str) -> str:
    """A validation error in the shape every other 422 has (the schema OpenAPI declares)."""
    if stat not in STATS:
        raise RequestValidationError(
            [
                {
                    "loc": ("query", "stat"),
                    "msg": f"unknown statistic {stat!r}; expected one of {STATS}",
                    "type": "value_error",
                }
            ]
        )
    return stat


def _layer_idx(session: Session, run_id: int, layer: str, stat: str = LAYER_STATS[0]) -> int:
    idx = layer_reads.layer_index(session, run_id, layer, stat)
    if idx is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} has no layer {layer!r}")
    return int(idx)


@router.get("/{run_id}/steps", response_model=StepSeries)
def get_steps(
    run_id: RunReadDep,
    session: SessionDep,
    rank: RankQuery = 0,
    start: StartQuery = None,
    end: EndQuery = None,
    max_points: MaxPointsQuery = DEFAULT_MAX_POINTS,
) -> Response:
    """One rank's steps as columns ordered by step, min/max-downsampled beyond max_points,
    with activation_norm_spike's threshold per point and the run's rule lines."""
    answer = series.step_series(session, run_id, rank, start=start, end=end, max_points=max_points)
    answer.rule_lines = rule_lines(session, run_id, answer)
    return _json(answer)


@router.get("/{run_id}/abandoned-steps", response_model=AbandonedTails)
def get_abandoned_steps(run_id: RunIdDep, session: SessionDep, rank: RankQuery = 0) -> Response:
    """One rank's steps that resumes abandoned (`watch(resume_from=plan)`): per resume, the
    steps recorded after the plan's checkpoint before the resume, for the rollback view."""
    return _json(rollback.abandoned_tails(session, run_id, rank))


@router.get("/{run_id}/layers", response_model=LayerMatrix)
def get_layers(
    run_id: RunReadDep,
    session: SessionDep,
    stat: StatQuery = LAYER_STATS[0],
    rank: RankQuery = 0,
    start: StartQuery = None,
    end: EndQuery = None,
    max_steps: Annotated[
        int, Query(ge=1, le=MAX_POINTS_LIMIT, description="Most rows (step buckets).")
    ] = DEFAULT_HEATMAP_STEPS,
    max_layers: Annotated[
        int, Query(ge=1, le=MAX_POINTS_LIMIT, description="Most columns (layer groups).")
    ] = DEFAULT_HEATMAP_LAYERS,
) -> Response:
    """One per-layer statistic as a steps x layers matrix, bucket maxima beyond the limits."""
    return _json(
        layer_reads.layer_matrix(
            session,
            run_id,
            _known_stat(stat),
            rank,
            start=start,
            end=end,
            max_steps=max_steps,
            max_layers=max_layers,
        )
    )


@router.get("/{run_id}/layers/full", response_model=FullLayers)
def get_full_layers(
    run_id: RunIdDep,
    session: SessionDep,
    step: Annotated[
        int | None,
        Query(ge=0, le=MAX_BIGINT, description="A sampled step; the latest one by default."),
    ] = None,
) -> Response:
    """Every layer's gradient figures of the full tensor at one sampled step, combined
    over the ranks' shard records (`ampwatch.server.full_layers` says which are exact)."""
    if step is None:
        step = full_layers.latest_sampled_step(session, run_id)
    answer = None if step is None else full_layers.full_layer_stats(session, run_id, step)
    if answer is None:
        where = "" if step is None else f" at step {step}"
        raise HTTPException(status_code=404, detail=f"run {run_id} has no layer statistics{where}")
    return _json(answer)


@router.get("/{run_id}/layers/{layer:path}/series", response_model=LayerSeries)
def get_layer_series(
    run_id: RunReadDep,
    layer: str,
    session: SessionDep,
    stat: StatQuery = LAYER_STATS[0],
    rank: RankQuery = 0,
    start: StartQuery = None,
    end: EndQuery = None,
    max_points: MaxPointsQuery = DEFAULT_MAX_POINTS,
) -> Response:
    """One layer's statistic over steps, min/max-downsampled beyond max_points."""
    return _json(
        layer_reads.layer_series(
            session,
            run_id,
            layer,
            _layer_idx(session, run_id, layer, _known_stat(stat)),
            stat,
            rank,
            start=start,
            end=end,
            max_points=max_points,
        )
    )


@router.get("/{run_id}/layers/{layer:path}/histograms", response_model=LayerHistograms)
def get_layer_histograms(
    run_id: RunReadDep,
    layer: str,
    session: SessionDep,
    rank: RankQuery = 0,
    step: Annotated[
        int | None, Query(ge=0, le=MAX_BIGINT, description="Exactly this step.")
    ] = None,
    start: StartQuery = None,
    end: EndQuery = None,
    max_points: Annotated[
        int, Query(ge=1, le=MAX_POINTS_LIMIT, description="Most histograms returned.")
    ] = DEFAULT_HISTOGRAMS,
) -> Response:
    """One layer's gradient exponent histograms at `step`, or over [start, end] thinned."""
    if step is not None:
        start = end = step
    return _json(
        history.layer_histograms(
            session,
            run_id,
            layer,
            _layer_idx(session, run_id, layer),
            rank,
            start=start,
            end=end,
            max_points=max_points,
        )
    )


@router.get("/{run_id}/events")
def get_events(run_id: RunReadDep, session: SessionDep) -> EventsPublic:
    """A run's events in time order."""
    return queries.run_events(session, run_id)


@router.get("/{run_id}/checkpoints")
def get_checkpoints(run_id: RunReadDep, session: SessionDep) -> CheckpointsPublic:
    """The checkpoints the agent reported, in time order (the restart advisor's candidates)."""
    return history.run_checkpoints(session, run_id)
