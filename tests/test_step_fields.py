"""A step field is `wire.STEP_FLOAT_FIELDS` plus the places ARCHITECTURE.md's "where to
change" row names, and every one of them carries every field.

Ingest, the rollups and the series follow the tuple by name, so a field missing from one of
these places fails here rather than as a silent NULL column or a dropped chart series
(issue 30: adding a field must be the row and nothing else).
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from ampwatch.agent import wire
from ampwatch.dashboard import series_types
from ampwatch.server import step_models
from ampwatch.server.rollups import ROLLUP_COLUMNS
from ampwatch.server.schemas import runs
from ampwatch.server.schemas import wire as wire_schema

FIELDS = set(wire.STEP_FLOAT_FIELDS)


@pytest.mark.parametrize(
    ("place", "names"),
    [
        ("wire.StepRecord", lambda: set(typing.get_type_hints(wire.StepRecord))),
        ("schemas.wire.StepIn", lambda: set(wire_schema.StepIn.model_fields)),
        ("schemas.runs.StepSeries", lambda: set(runs.StepSeries.model_fields)),
        ("step_models.Step", lambda: set(step_models.Step.__table__.columns.keys())),
        (
            "dashboard series_types.StepSeries",
            lambda: {f.name for f in dataclasses.fields(series_types.StepSeries)},
        ),
    ],
)
def test_every_place_of_the_row_carries_every_step_field(place: str, names: typing.Any) -> None:
    assert FIELDS - names() == set(), place


def test_the_rollups_hold_each_fields_extremes() -> None:
    extremes = {f"{field}_{end}" for field in FIELDS for end in ("min", "max")}
    assert extremes <= set(ROLLUP_COLUMNS)
    for table in (step_models.StepRollup, step_models.StepRollupLevel):
        assert extremes <= set(table.__table__.columns.keys()), table.__name__
