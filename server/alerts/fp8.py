"""`fp8_risk`: a layer that the FP8 recipe its run declares (`watch(fp8_recipe=...)`, in the
run_start event) does not fit, judged on the agent's FP8 samples (`ampwatch.agent.fp8`).

"Fits" is the FP8 readiness view's rule (`fp8_readiness.recipe_scores` against
`Fp8Limits`, which the rule's settings extend): a layer's score is its worst role's worst
share (flush, saturate) or error as a multiple of its limit. A sample's roles arrive as one
record each, at one step, and are judged together; a layer's count of consecutive failing
samples (`for_samples`) and its last judged FP8 step live in `layers.LayerState`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ampwatch.agent import wire
from ampwatch.server.alerts.layer_settings import Fp8Risk
from ampwatch.server.alerts.lifecycle import Tracker
from ampwatch.server.alerts.rule_settings import RuleSettings
from ampwatch.server.fp8_readiness import recipe_scores
from ampwatch.server.schemas.wire import LayerStatsIn

if TYPE_CHECKING:
    from ampwatch.server.alerts.layers import LayerState

RULE = "fp8_risk"
#: A record carrying any of these is (part of) an FP8 sample.
FP8_RECORD_STATS = frozenset(wire.FP8_STATS)
_SCALING_WORDS = {"tensor": "per-tensor", "tile": "1x128 tiles", "block": "128x128 blocks",
                  "mx": "MX 1x32 blocks"}  # fmt: skip
_METRIC_WORDS = {"flush": "would flush to zero", "saturate": "would saturate",
                 "error": "relative error"}  # fmt: skip


def fp8_risk(
    tracker: Tracker,
    state: LayerState,
    records: list[LayerStatsIn],
    recipe: str | None,
    settings: dict[str, RuleSettings],
) -> None:
    """Judge the FP8 `records` (of steps in order) against the declared `recipe`; a run
    that declares none is not judged."""
    rule = settings[RULE]
    assert isinstance(rule, Fp8Risk)
    if recipe is None or not rule.enabled:
        return
    samples: dict[tuple[int, int], list[LayerStatsIn]] = {}
    for record in records:
        samples.setdefault((record.step, record.rank), []).append(record)
    for (step, rank), sample in sorted(samples.items()):
        _judge(tracker, state, step, rank, sample, recipe, rule)


def _judge(
    tracker: Tracker,
    state: LayerState,
    step: int,
    rank: int,
    sample: list[LayerStatsIn],
    recipe: str,
    rule: Fp8Risk,
) -> None:
    names: list[str] = []
    position: dict[str, int] = {}
    for record in sample:
        for name in record.names:
            if name not in position:
                position[name] = len(names)
                names.append(name)
    width = len(names)
    data: dict[tuple[str, int], np.ndarray] = {}
    for record in sample:  # each role's record holds that role's layers
        columns = np.fromiter((position[n] for n in record.names), np.intp, len(record.names))
        for stat, values in record.stats.items():
            if stat in FP8_RECORD_STATS:
                vector = data.setdefault((stat, step), np.full(width, np.nan))
                vector[columns] = values
    score, by_role = recipe_scores(data, step, recipe, rule, width)
    idx = state.indices(names, rank)
    fresh = (state.owner[idx] == rank) & (state.fp8_last[idx] < step)
    valid = fresh & ~np.isnan(score)
    risky = valid & (score > rule.max_score)
    hits = np.where(risky, state.fp8_hits[idx] + 1, np.where(valid, 0, state.fp8_hits[idx]))
    state.fp8_hits[idx] = hits
    state.fp8_last[idx[fresh]] = step
    for j in np.flatnonzero(risky):
        name = names[j]
        if tracker.still_firing(RULE, name):
            continue
        roles = {role: float(v[j]) for role, v in by_role.items() if not np.isnan(v[j])}
        detail = _detail(name, step, recipe, rule, roles, data, int(j))
        tracker.holds(RULE, step, detail, layer=name, ready=bool(hits[j] >= rule.for_samples))
    tracker.clear_layers(RULE, step, names, valid & ~risky)


def _detail(
    name: str,
    step: int,
    recipe: str,
    rule: Fp8Risk,
    roles: dict[str, float],
    data: dict[tuple[str, int], np.ndarray],
    j: int,
) -> Any:
    """The alert's message and values: the worst role's worst measure against its limit."""
    role = max(roles, key=lambda r: roles[r])
    fmt, scaling = wire.FP8_RECIPES[recipe][role]
    measured = {m: float(data[(wire.fp8_stat(role, fmt, scaling, m), step)][j])
                for m in wire.FP8_METRICS}  # fmt: skip
    limits = {m: rule.limit(m, fmt) for m in wire.FP8_METRICS}

    def ratio(m: str) -> float:
        if limits[m] > 0:
            return measured[m] / limits[m]
        return float("inf") if measured[m] > 0 else 0.0

    metric = max((m for m in wire.FP8_METRICS if not np.isnan(measured[m])), key=ratio)
    value, limit, score = measured[metric], limits[metric], roles[role]

    def detail() -> tuple[str, dict[str, Any]]:
        said = (f"{value:.1%} of its elements {_METRIC_WORDS[metric]}" if metric != "error"
                else f"its {_METRIC_WORDS[metric]} is {value:.3f}")  # fmt: skip
        shown = f"{limit:.1%}" if metric != "error" else f"{limit:.3f}"
        return (
            (f"layer {name}: under the declared FP8 recipe {recipe}, its {role} "
             f"({fmt.upper()}, {_SCALING_WORDS[scaling]}): {said} (limit {shown}; score "
             f"{score:.3g} > {rule.max_score:g}) at step {step}: the recipe does not fit "
             "this layer (finer scaling, or keep it in BF16: see its FP8 readiness)"),
            {"recipe": recipe, "role": role, "format": fmt, "scaling": scaling,
             "metric": metric, "value": value, "limit": limit, "score": _json(score),
             "max_score": rule.max_score, "role_scores": {r: _json(v) for r, v in roles.items()},
             "measures": {m: v for m, v in measured.items() if not np.isnan(v)},
             "step": step},
        )  # fmt: skip

    return detail


def _json(score: float) -> float | None:
    """A score for the alert's JSON values: infinite (a limit of 0 exceeded) as null."""
    return score if math.isfinite(score) else None
