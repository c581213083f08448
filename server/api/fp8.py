"""`/api/v1/runs/{id}/fp8-readiness` and `…/loss-scale-advice` (`ampwatch.server.fp8_readiness`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from ampwatch.server.api.deps import RUN_ERRORS, RunIdDep, SessionDep
from ampwatch.server.fp8_readiness import (
    Fp8Limits,
    Fp8Readiness,
    LossScaleAdvice,
    fp8_readiness,
    loss_scale_advice,
)
from ampwatch.server.schemas import MAX_INT

router = APIRouter(prefix="/runs", tags=["fp8 readiness"], responses=RUN_ERRORS)

RankQuery = Annotated[int, Query(ge=0, le=MAX_INT, description="Data-parallel rank.")]
MaxStepsQuery = Annotated[
    int, Query(ge=2, le=1000, description="Most sampled steps read over the run.")
]
_DEFAULTS = Fp8Limits()


@router.get("/{run_id}/fp8-readiness")
def get_fp8_readiness(
    run_id: RunIdDep,
    session: SessionDep,
    rank: RankQuery = 0,
    max_steps: MaxStepsQuery = 64,
    max_flush: Annotated[float, Query(ge=0, le=1, allow_inf_nan=False,
                                      description="Largest share that may flush.")]
    = _DEFAULTS.max_flush,
    max_saturate: Annotated[float, Query(ge=0, le=1, allow_inf_nan=False,
                                         description="Largest share that may saturate.")]
    = _DEFAULTS.max_saturate,
    max_error_e4m3: Annotated[float, Query(ge=0, le=10, allow_inf_nan=False,
                                           description="Largest relative error in E4M3.")]
    = _DEFAULTS.max_error_e4m3,
    max_error_e5m2: Annotated[float, Query(ge=0, le=10, allow_inf_nan=False,
                                           description="Largest relative error in E5M2.")]
    = _DEFAULTS.max_error_e5m2,
) -> Fp8Readiness:
    """Per Linear layer at the latest FP8 sample: each recipe's fit with the numbers behind
    it, a verdict (fits / needs_finer_scaling / keep_bf16), worst first, and the trend."""
    limits = Fp8Limits(max_flush=max_flush, max_saturate=max_saturate,
                       max_error_e4m3=max_error_e4m3, max_error_e5m2=max_error_e5m2)
    return fp8_readiness(session, run_id, rank=rank, limits=limits, max_steps=max_steps)


@router.get("/{run_id}/loss-scale-advice")
def get_loss_scale_advice(
    run_id: RunIdDep, session: SessionDep, rank: RankQuery = 0, max_steps: MaxStepsQuery = 64
) -> LossScaleAdvice:
    """FP16: the loss scales 2^k that flushed and overflowed nothing in the gradients'
    exponent histograms so far, and an init_scale / growth_interval with its reason."""
    return loss_scale_advice(session, run_id, rank=rank, max_steps=max_steps)
