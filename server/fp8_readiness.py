"""FP8 readiness per run (layers x recipes, a verdict per layer, its trend), read from what
the agent already stored; with the reads it shares with the loss-scale advice for FP16 runs
(`ampwatch.server.loss_scale_advice`): the latest `run_start`, sampled steps thinned to a
bound, layer vectors of statistics at steps.

The agent's `fp8_*` layer statistics (`ampwatch.agent.fp8`) say, per Linear layer and role
(weight, gradient, input activation), which share would flush, saturate, and the relative
error under every format x scaling. A recipe (`wire.FP8_RECIPES`) picks one (format,
scaling) per role; a layer fits a recipe when every measured role is within the limits
(`Fp8Limits`). Its score under a recipe is the worst role's ratio to its limit (<= 1 fits),
so "worst first" is an order across metrics. Verdict: `fits` (per-tensor scaling fits),
`needs_finer_scaling` (per-tensor does not, a blockwise or MX recipe does), `keep_bf16`
(none does).

Reads are bounded whatever the run's length: the latest sample's rows (one per statistic)
and, for the trend, the recipes' statistics at <= `max_steps` sampled steps spread over the
run.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.agent import wire
from ampwatch.server.layer_models import Layer, LayerStat
from ampwatch.server.models import Event
from ampwatch.server.packed import unpack_matrix

VERDICTS = ("fits", "needs_finer_scaling", "keep_bf16")
#: The recipe whose fit means "fits"; the others are the finer ones.
PER_TENSOR = "per_tensor"
_PROBE_STAT = wire.fp8_stat("weight", "e4m3", "tensor", "flush")  # in every FP8 sample


class Fp8Limits(BaseModel):
    """What "fits" means: shares of a tensor's elements, and the relative L2 error per
    format (defaults ~2x the rounding error of Gaussian data: 0.026 in E4M3, 0.052 in E5M2,
    measured by the agent's tests' data), so that only loss beyond rounding fails."""

    max_flush: float = Field(
        0.01, ge=0, le=1,
        description="A recipe fits a role when at most this share of its elements would "
        "round to zero in FP8 (a per-tensor scale set by a few outliers flushes the rest).",
    )  # fmt: skip
    max_saturate: float = Field(
        0.001, ge=0, le=1,
        description="...and at most this share would saturate (clip at the format's max).",
    )  # fmt: skip
    max_error_e4m3: float = Field(
        0.06, ge=0, le=10,
        description="...and its relative L2 error in E4M3 is at most this (~2x the rounding "
        "error of Gaussian data, 0.026), so only loss beyond rounding fails.",
    )  # fmt: skip
    max_error_e5m2: float = Field(
        0.12, ge=0, le=10,
        description="...and in E5M2 at most this (~2x its rounding error, 0.052).",
    )  # fmt: skip

    def max_error(self, fmt: str) -> float:
        return self.max_error_e4m3 if fmt == "e4m3" else self.max_error_e5m2

    def limit(self, metric: str, fmt: str) -> float:
        """The limit of `metric` (wire.FP8_METRICS) in format `fmt`."""
        if metric == "flush":
            return self.max_flush
        return self.max_saturate if metric == "saturate" else self.max_error(fmt)


class RoleMeasure(BaseModel):
    format: str
    scaling: str
    flush: float
    saturate: float
    error: float
    score: float


class RecipeFit(BaseModel):
    fits: bool
    score: float
    #: role -> what the recipe does to it; a role absent was not measured for this layer.
    roles: dict[str, RoleMeasure]


class Fp8Layer(BaseModel):
    layer: str
    verdict: str
    fits_with: list[str]
    reason: str
    recipes: dict[str, RecipeFit]
    #: role -> "{fmt}_{scaling}" -> {flush, saturate, error}; role -> scaling -> spread.
    measures: dict[str, dict[str, dict[str, float]]]
    spread: dict[str, dict[str, float]]
    #: recipe -> score at each of the answer's `steps` (null: layer not measured then).
    trend: dict[str, list[float | None]]
    #: recipe -> the first sampled step it no longer fit at, after fitting at the first
    #: sample where this layer was measured (late divergence), else null.
    stopped_fitting: dict[str, int | None]


class Fp8Readiness(BaseModel):
    run_id: int
    rank: int
    step: int | None
    steps: list[int]
    declared_recipe: str | None
    recipes: dict[str, dict[str, tuple[str, str]]]
    limits: Fp8Limits
    summary: dict[str, int]
    layers: list[Fp8Layer]


def latest_run_start(session: Session, run_id: int) -> dict[str, object]:
    """The data of the run's latest `run_start` event ({} without one): what the process
    that reports now declared (precision, recipe, sharding)."""
    data = session.scalar(
        select(Event.data)
        .where(Event.run_id == run_id, Event.kind == "run_start")
        .order_by(Event.time.desc(), Event.id.desc())
        .limit(1)
    )
    return dict(data) if data else {}


def recipe_of(run_start: dict[str, object]) -> str | None:
    """The FP8 recipe a run_start event's data declares (`watch(fp8_recipe=...)`), if a
    known one: the readiness view and the `fp8_risk` alert read it the same way."""
    recipe = run_start.get("fp8_recipe")
    return recipe if isinstance(recipe, str) and recipe in wire.FP8_RECIPES else None


def declared_recipe(session: Session, run_id: int) -> str | None:
    """The FP8 recipe the run's latest run_start declared."""
    return recipe_of(latest_run_start(session, run_id))


def thin_steps(steps: list[int], limit: int) -> list[int]:
    """<= limit steps evenly over `steps`, the last always kept."""
    if len(steps) <= limit:
        return steps
    stride = -(-len(steps) // limit)
    thinned = steps[::stride]
    return thinned if thinned[-1] == steps[-1] else [*thinned[: limit - 1], steps[-1]]


def layer_vectors(
    session: Session, run_id: int, rank: int, stats: list[str], steps: list[int], width: int
) -> dict[tuple[str, int], np.ndarray]:
    """(stat, step) -> the layer vector (NaN where the layer was not in that record)."""
    rows = session.execute(
        select(LayerStat.stat, LayerStat.step, LayerStat.values).where(
            LayerStat.run_id == run_id, LayerStat.rank == rank,
            LayerStat.stat.in_(stats), LayerStat.step.in_(steps),
        )
    ).all()  # fmt: skip
    values, missing = unpack_matrix([blob for _, _, blob in rows], width)
    values = np.where(missing, np.nan, values)
    return {(stat, step): values[i] for i, (stat, step, _) in enumerate(rows)}


def _recipe_stats(recipe: str) -> list[tuple[str, str, str, str, str]]:
    """(role, fmt, scaling, metric, stat name) the recipe's verdict reads."""
    return [
        (role, fmt, scaling, metric, wire.fp8_stat(role, fmt, scaling, metric))
        for role, (fmt, scaling) in wire.FP8_RECIPES[recipe].items()
        for metric in wire.FP8_METRICS
    ]


def recipe_scores(
    data: dict[tuple[str, int], np.ndarray],
    step: int,
    recipe: str,
    limits: Fp8Limits,
    n_layers: int,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Per layer: the recipe's score (NaN: no role measured) and each role's score."""
    by_role: dict[str, np.ndarray] = {}
    nan = np.full(n_layers, np.nan)
    for role, fmt, _, metric, stat in _recipe_stats(recipe):
        limit = limits.limit(metric, fmt)
        ratio = data.get((stat, step), nan) / limit if limit > 0 else np.where(
            data.get((stat, step), nan) > 0, np.inf, 0.0)  # fmt: skip
        by_role[role] = np.fmax(by_role.get(role, nan), ratio)
    total = nan
    for role_score in by_role.values():
        total = np.fmax(total, role_score)
    return total, by_role


def percent(value: float) -> str:
    """A share as a reason quotes it: to 0.1%, or to 0.001% below 0.1%."""
    return f"{value:.1%}" if value >= 0.001 or value == 0 else f"{value:.3%}"


def _reason(layer: Fp8Layer, limits: Fp8Limits) -> str:
    """One sentence with the numbers behind the verdict: the per-tensor recipe's worst
    role, then what the best finer recipe does to that role."""
    base = layer.recipes.get(PER_TENSOR)
    if base is None or not base.roles:
        return "not measured"
    role, worst = max(base.roles.items(), key=lambda item: item[1].score)
    said = (
        f"per-tensor {worst.format.upper()}: {role} flush {percent(worst.flush)}, "
        f"saturate {percent(worst.saturate)}, error {worst.error:.3f}"
    )
    if layer.verdict == "fits":
        return f"fits every limit; {said}"
    finer = [(name, fit) for name, fit in layer.recipes.items() if name != PER_TENSOR]
    name, fit = min(finer, key=lambda item: item[1].score)
    other = fit.roles.get(role)
    then = (
        (
            f"; {name} ({other.scaling} {other.format.upper()}): flush {percent(other.flush)}, "
            f"saturate {percent(other.saturate)}, error {other.error:.3f}"
        )
        if other
        else ""
    )
    limit = f" (limits: flush {percent(limits.max_flush)}, saturate {percent(limits.max_saturate)})"
    return said + then + limit


def fp8_readiness(
    session: Session,
    run_id: int,
    *,
    rank: int = 0,
    limits: Fp8Limits | None = None,
    max_steps: int = 64,
) -> Fp8Readiness:
    """The run's FP8 readiness at its latest FP8 sample, worst layers first, with each
    layer's score per recipe over <= `max_steps` samples.

    >>> # fp8_readiness(session, run_id).layers[0].verdict -> "needs_finer_scaling"
    """
    limits = limits or Fp8Limits()
    names = list(session.scalars(select(Layer.name).where(Layer.run_id == run_id)
                                 .order_by(Layer.idx)))  # fmt: skip
    all_steps = list(session.scalars(
        select(LayerStat.step).where(LayerStat.run_id == run_id, LayerStat.rank == rank,
                                     LayerStat.stat == _PROBE_STAT).order_by(LayerStat.step)
    ))  # fmt: skip
    answer = Fp8Readiness(
        run_id=run_id, rank=rank, step=all_steps[-1] if all_steps else None, steps=[],
        declared_recipe=declared_recipe(session, run_id), recipes=dict(wire.FP8_RECIPES),
        limits=limits, summary=dict.fromkeys(VERDICTS, 0), layers=[],
    )  # fmt: skip
    if not all_steps:
        return answer
    last = all_steps[-1]
    steps = thin_steps(all_steps, max_steps)
    trend_stats = sorted({s for r in wire.FP8_RECIPES for *_, s in _recipe_stats(r)})
    data = layer_vectors(session, run_id, rank, trend_stats, steps, len(names))
    latest = layer_vectors(session, run_id, rank, list(wire.FP8_STATS), [last], len(names))
    scores = {
        recipe: [recipe_scores(data, step, recipe, limits, len(names))[0] for step in steps]
        for recipe in wire.FP8_RECIPES
    }
    now = {
        recipe: recipe_scores(latest, last, recipe, limits, len(names))
        for recipe in wire.FP8_RECIPES
    }
    layers = []
    for i, name in enumerate(names):
        if np.isnan(now[PER_TENSOR][0][i]) and all(np.isnan(v[0][i]) for v in now.values()):
            continue  # not a Linear layer, or not measured at the latest sample
        layers.append(_layer(i, name, latest, last, now, scores, steps, limits))
    severity = {verdict: n for n, verdict in enumerate(VERDICTS)}
    layers.sort(key=lambda layer: (
        -severity[layer.verdict],
        -min(fit.score for fit in layer.recipes.values()),
        -layer.recipes[PER_TENSOR].score if PER_TENSOR in layer.recipes else 0.0,
    ))  # fmt: skip
    for layer in layers:
        answer.summary[layer.verdict] += 1
    answer.steps = steps
    answer.layers = layers
    return answer


def _layer(
    i: int,
    name: str,
    latest: dict[tuple[str, int], np.ndarray],
    last: int,
    now: dict[str, tuple[np.ndarray, dict[str, np.ndarray]]],
    scores: dict[str, list[np.ndarray]],
    steps: list[int],
    limits: Fp8Limits,
) -> Fp8Layer:
    def value(stat: str) -> float | None:
        vector = latest.get((stat, last))
        return None if vector is None or np.isnan(vector[i]) else float(vector[i])

    recipes: dict[str, RecipeFit] = {}
    for recipe, (total, by_role) in now.items():
        roles = {}
        for role, (fmt, scaling) in wire.FP8_RECIPES[recipe].items():
            got = {m: value(wire.fp8_stat(role, fmt, scaling, m)) for m in wire.FP8_METRICS}
            if any(v is None for v in got.values()):
                continue
            roles[role] = RoleMeasure(
                format=fmt, scaling=scaling, score=float(by_role[role][i]), **got
            )
        if roles:
            recipes[recipe] = RecipeFit(fits=bool(total[i] <= 1), score=float(total[i]),
                                        roles=roles)  # fmt: skip
    measures, spread = _measures(value)
    fits_with = [r for r, fit in recipes.items() if fit.fits]
    if PER_TENSOR in fits_with:
        verdict = "fits"
    elif fits_with:
        verdict = "needs_finer_scaling"
    else:
        verdict = "keep_bf16"
    trend, stopped = _trend(i, scores, steps)
    layer = Fp8Layer(layer=name, verdict=verdict, fits_with=fits_with, reason="",
                     recipes=recipes, measures=measures, spread=spread, trend=trend,
                     stopped_fitting=stopped)  # fmt: skip
    layer.reason = _reason(layer, limits)
    return layer


def _measures(
    value: Callable[[str], float | None],
) -> tuple[dict[str, dict[str, dict[str, float]]], dict[str, dict[str, float]]]:
    """A layer's measured figures per role and `{fmt}_{scaling}`, and its spreads, read
    through `value` (a statistic's value for the layer, None where not measured)."""
    measures: dict[str, dict[str, dict[str, float]]] = {}
    spread: dict[str, dict[str, float]] = {}
    for role in wire.FP8_ROLES:
        for fmt in wire.FP8_FORMATS:
            for scaling in wire.FP8_SCALINGS:
                got = {m: value(wire.fp8_stat(role, fmt, scaling, m)) for m in wire.FP8_METRICS}
                if all(v is not None for v in got.values()):
                    measures.setdefault(role, {})[f"{fmt}_{scaling}"] = got  # type: ignore[assignment]
        for scaling in wire.FP8_SPREAD_SCALINGS:
            if (v := value(wire.fp8_spread_stat(role, scaling))) is not None:
                spread.setdefault(role, {})[scaling] = v
    return measures, spread


def _trend(
    i: int, scores: dict[str, list[np.ndarray]], steps: list[int]
) -> tuple[dict[str, list[float | None]], dict[str, int | None]]:
    """Layer `i`'s score per recipe at each of `steps`, and the step each recipe stopped
    fitting at (after fitting at the layer's first measured sample), else None."""
    trend: dict[str, list[float | None]] = {}
    stopped: dict[str, int | None] = {}
    for recipe, series in scores.items():
        points = [None if np.isnan(s[i]) else float(s[i]) for s in series]
        trend[recipe] = [None if p is None else (p if math.isfinite(p) else 1e300)
                         for p in points]  # fmt: skip
        measured = [(step, p) for step, p in zip(steps, points, strict=True) if p is not None]
        stopped[recipe] = None
        if measured and measured[0][1] <= 1:
            stopped[recipe] = next((step for step, p in measured if p > 1), None)
    return trend, stopped
