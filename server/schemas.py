"""HTTP request and response models, named by role.

Field names, statistic names, event kinds and the non-finite float encoding all come from
`ampwatch.agent.wire`, the one contract between agent and collector. Incoming models are
strict (no "1.5" strings for numbers, no 0/1 for booleans) and forbid unknown fields, so an
agent bug is answered with a 422 that names the field instead of being half-understood.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from ampwatch.agent.wire import (
    EVENT_KINDS,
    LAYER_STATS,
    MAX_NAME_LENGTH,
    WIRE_VERSION,
    WireFloat,
    encode_float,
)
from ampwatch.server.models import RunStatus

#: Largest value that fits the BIGINT step and seq columns.
MAX_BIGINT = 2**63 - 1
#: Largest value that fits an INTEGER column (ranks).
MAX_INT = 2**31 - 1
#: Event times are Unix seconds; this bound (year 9999) keeps them convertible to datetime.
MAX_EVENT_TIME = 253_402_300_799.0

#: A name as stored: non-empty, bounded, and free of NUL, which PostgreSQL text rejects.
Name = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_NAME_LENGTH, pattern=r"^[^\x00]*$")
]
StepNumber = Annotated[int, Field(ge=0, le=MAX_BIGINT)]
Rank = Annotated[int, Field(ge=0, le=MAX_INT)]


class _WireModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class RunIn(_WireModel):
    client_run_id: Name
    name: Name
    project: Name = "default"


class StepIn(_WireModel):
    """One optimizer step; a missing or null float means "not measured"."""

    step: StepNumber
    rank: Rank = 0
    skipped: bool
    loss: WireFloat | None = None
    loss_scale: WireFloat | None = None
    grad_norm: WireFloat | None = None
    lr: WireFloat | None = None
    act_norm_mean: WireFloat | None = None
    act_norm_max: WireFloat | None = None


class LayerStatsIn(_WireModel):
    """Statistics for several layers at one step; every array is aligned with `names`."""

    step: StepNumber
    rank: Rank = 0
    names: list[Name]
    stats: dict[str, list[WireFloat]]

    @field_validator("stats")
    @classmethod
    def _known_stats(cls, stats: dict[str, list[WireFloat]]) -> dict[str, list[WireFloat]]:
        unknown = sorted(set(stats) - set(LAYER_STATS))
        if unknown:
            raise ValueError(f"unknown statistic(s) {unknown}; this collector knows {LAYER_STATS}")
        return stats

    @model_validator(mode="after")
    def _aligned(self) -> LayerStatsIn:
        if len(set(self.names)) != len(self.names):
            raise ValueError("names must be unique within one layer_stats record")
        for stat, values in self.stats.items():
            if len(values) != len(self.names):
                raise ValueError(
                    f"stats[{stat!r}] has {len(values)} values for {len(self.names)} names; "
                    "each array must hold one value per name, in the same order"
                )
        return self


class EventIn(_WireModel):
    kind: str
    step: StepNumber | None = None
    time: Annotated[float, Field(ge=0, le=MAX_EVENT_TIME, allow_inf_nan=False)]
    data: dict[str, Any] = Field(default_factory=dict)

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {kind!r}; expected one of {EVENT_KINDS}")
        return kind

    @field_validator("data")
    @classmethod
    def _wire_encode_data(cls, data: dict[str, Any]) -> dict[str, Any]:
        # A JSON parser may accept NaN/Infinity literals; stored JSON must not contain them.
        return _encode_non_finite(data)  # type: ignore[no-any-return]


class BatchIn(_WireModel):
    """One wire batch (layout: `ampwatch.agent.wire`)."""

    wire_version: int
    run: RunIn
    seq: StepNumber
    steps: list[StepIn] = Field(default_factory=list)
    layer_stats: list[LayerStatsIn] = Field(default_factory=list)
    events: list[EventIn] = Field(default_factory=list)
    dropped: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)

    @field_validator("wire_version")
    @classmethod
    def _supported_version(cls, version: int) -> int:
        if version != WIRE_VERSION:
            raise ValueError(
                f"wire_version {version} is not supported: this collector speaks wire_version "
                f"{WIRE_VERSION}; run an agent and collector of matching releases"
            )
        return version


def _encode_non_finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return encode_float(value)
    if isinstance(value, dict):
        return {key: _encode_non_finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_encode_non_finite(item) for item in value]
    return value


class IngestAck(BaseModel):
    run_id: int
    seq: int
    duplicate: bool


class RunPublic(BaseModel):
    id: int
    client_run_id: str
    name: str
    project: str
    status: RunStatus
    created_at: datetime
    last_seen_at: datetime
    steps: int
    last_step: int | None
    last_loss_scale: WireFloat | None
    skipped_steps: int


class RunsPublic(BaseModel):
    runs: list[RunPublic]


class StepSeries(BaseModel):
    """Columnar steps of one rank, ordered by step; floats in the wire encoding."""

    step: list[int]
    loss: list[WireFloat | None]
    loss_scale: list[WireFloat | None]
    skipped: list[bool]
    grad_norm: list[WireFloat | None]
    lr: list[WireFloat | None]
    act_norm_mean: list[WireFloat | None]
    act_norm_max: list[WireFloat | None]


class LayerMatrix(BaseModel):
    """One statistic as a steps x layers matrix (`values[i][j]`: steps[i], layers[j]).

    null: the layer was not in that step's record; "NaN": the statistic itself was NaN.
    """

    stat: str
    layers: list[str]
    steps: list[int]
    values: list[list[WireFloat | None]]


class EventPublic(BaseModel):
    """An event as the agent sent it; `time` in Unix seconds, as on the wire."""

    kind: str
    step: int | None
    time: float
    data: dict[str, Any]


class EventsPublic(BaseModel):
    events: list[EventPublic]
