"""`/api/v1/runs/{id}/fp8-readiness` and `…/loss-scale-advice` (`ampwatch.server.fp8_readiness`,
`ampwatch.server.loss_scale_advice`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from ampwatch.server.api.deps import RUN_ERRORS, RunIdDep, SessionDep, SessionRoute
from ampwatch.server.api.run_data import RankQuery
from ampwatch.server.fp8_readiness import Fp8Limits, Fp8Readiness, fp8_readiness
from ampwatch.server.loss_scale_advice import LossScaleAdvice, loss_scale_advice

router = APIRouter(
    route_class=SessionRoute, prefix="/runs", tags=["fp8 readiness"], responses=RUN_ERRORS
)

MaxStepsQuery = Annotated[
    int, Query(ge=2, le=1000, description="Most sampled steps read over the run.")
]
_DEFAULTS = Fp8Limits()


def _limit(description: str, high: float = 1.0) -> object:
    return Query(ge=0, le=high, allow_inf_nan=False, description=description)


ShareLimit = Annotated[float, _limit("Largest share of a tensor's elements allowed.")]
ErrorLimit = Annotated[float, _limit("Largest relative L2 quantisation error allowed.", 10.0)]


@router.get("/{run_id}/fp8-readiness")
def get_fp8_readiness(
    run_id: RunIdDep,
    session: SessionDep,
    rank: RankQuery = 0,
    max_steps: MaxStepsQuery = 64,
    max_flush: ShareLimit = _DEFAULTS.max_flush,
    max_saturate: ShareLimit = _DEFAULTS.max_saturate,
    max_error_e4m3: ErrorLimit = _DEFAULTS.max_error_e4m3,
    max_error_e5m2: ErrorLimit = _DEFAULTS.max_error_e5m2,
) -> Fp8Readiness:
    """Per Linear layer at the latest FP8 sample: each recipe's fit with the numbers behind
    it, a verdict (fits / needs_finer_scaling / keep_bf16), worst first, and the trend."""
    limits = Fp8Limits(
        max_flush=max_flush,
        max_saturate=max_saturate,
        max_error_e4m3=max_error_e4m3,
        max_error_e5m2=max_error_e5m2,
    )
    return fp8_readiness(session, run_id, rank=rank, limits=limits, max_steps=max_steps)


@router.get("/{run_id}/loss-scale-advice")
def get_loss_scale_advice(
    run_id: RunIdDep, session: SessionDep, rank: RankQuery = 0, max_steps: MaxStepsQuery = 64
) -> LossScaleAdvice:
    """FP16: the loss scales 2^k that flushed and overflowed nothing in the gradients'
    exponent histograms so far, and an init_scale / growth_interval with its reason."""
    return loss_scale_advice(session, run_id, rank=rank, max_steps=max_steps)
