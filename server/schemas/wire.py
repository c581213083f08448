"""The ingest request: a wire batch (`BatchIn`) and its records, as the collector validates
them. Field names, statistic names, event kinds and the non-finite float encoding all come
from `ampwatch.agent.wire`, the one contract between agent and collector. Incoming models
are strict (no "1.5" strings for numbers, no 0/1 for booleans) and forbid unknown fields,
so an agent bug is answered with a 422 that names the field instead of being
half-understood."""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
import numpy.typing as npt
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StringConstraints,
    field_validator,
    model_validator,
)

from ampwatch.agent.wire import (
    DROPPED_KINDS,
    EVENT_KINDS,
    EXPONENT_HISTOGRAM_BINS,
    LAYER_STATS,
    MAX_GRAD_PARTS,
    MAX_LR_GROUPS,
    MAX_NAME_LENGTH,
    NON_FINITE,
    PARAMETER_STATS,
    STREAM_MAX_LENGTH,
    STREAM_PATTERN,
    WIRE_VERSION,
    WireFloat,
    decode_float,
    encode_nested,
)

#: Largest value that fits the BIGINT step and seq columns.
MAX_BIGINT = 2**63 - 1
#: Largest value that fits an INTEGER column (ranks).
MAX_INT = 2**31 - 1
#: Event times are Unix seconds; this bound (year 9999) keeps them convertible to datetime.
MAX_EVENT_TIME = 253_402_300_799.0
#: Most records (steps + layer_stats + events), layer values (names x statistics, over its
#: layer_stats) and distinct layer (and module) names in one batch. A batch is one
#: transaction, and on SQLite one writer at a time, so these bound how long one tenant's
#: batch keeps another's waiting (`bench/ingest_lock.py`, on a loaded 2-core machine):
#: at 65,536 new names, 1.8 M values and 50,000 records it held the lock for 41-53 s and
#: the other tenant got 503s. What a batch costs inside the lock, there: ~0.2 ms a step
#: record (the rules judge each), ~60 us a new name, ~4 us a layer value. The records
#: bound is twice the agent's seal (2,000); the values bound 1,000 layers x 4 statistics x
#: 100 samples with room; the names bound a large MoE's parameter tensors.
MAX_BATCH_RECORDS = 4_000
MAX_BATCH_LAYER_VALUES = 500_000
MAX_BATCH_LAYER_NAMES = 16_384
#: Deepest nesting of an event's free-form `data`: 300 levels were stored, and then every
#: read that renders events or alerts answered 500 (the serialiser's recursion limit).
MAX_DATA_DEPTH = 16

#: A name as stored: non-empty, bounded, and free of NUL, which PostgreSQL text rejects.
Name = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_NAME_LENGTH, pattern=r"^[^\x00]*$")
]
#: Largest step number accepted: 2^53 - 1, the largest integer the dashboard's JavaScript
#: holds exactly, with room below BIGINT for the arithmetic reads do on steps (2^63 - 1
#: was stored, then the restart advisor answered 500, "bigint out of range").
MAX_STEP = 2**53 - 1
StepNumber = Annotated[int, Field(ge=0, le=MAX_STEP)]
Seq = Annotated[int, Field(ge=0, le=MAX_BIGINT)]
Rank = Annotated[int, Field(ge=0, le=MAX_INT)]
#: The sending process's id (wire `STREAM_*`): part of the idempotency key with run and seq.
Stream = Annotated[
    str, StringConstraints(min_length=1, max_length=STREAM_MAX_LENGTH, pattern=STREAM_PATTERN)
]


class _WireModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class RunIn(_WireModel):
    client_run_id: Name
    name: Name
    project: Name = "default"


_NUMBER_TYPES = frozenset({float, int})


def _wire_float_array(value: Any) -> npt.NDArray[np.float64]:
    """A JSON array of wire floats as one float64 array, checked as a whole.

    Layer statistics are most of what agents send (layers x statistics per sampled step);
    validating them value by value as pydantic unions cost more than parsing the JSON.
    The element types are collected in one C-level pass; only an array that holds strings
    takes the slower path that maps the non-finite markers.
    """
    if not isinstance(value, list):
        # ValueError, not TypeError: pydantic turns only ValueError into a 422 detail.
        raise ValueError("must be an array of numbers")
    kinds = set(map(type, value))
    try:
        if kinds <= _NUMBER_TYPES:
            return np.array(value, dtype=np.float64)
        if kinds - _NUMBER_TYPES != {str}:
            raise ValueError(
                "values must be numbers or one of "
                f"{sorted(NON_FINITE)}, not {sorted(k.__name__ for k in kinds - _NUMBER_TYPES)}"
            )
        unknown = {v for v in value if type(v) is str} - NON_FINITE.keys()
        if unknown:
            raise ValueError(
                f"{sorted(unknown)[:3]} not numbers; non-finite floats are written as one of "
                f"{sorted(NON_FINITE)}"
            )
        return np.array([NON_FINITE.get(v, v) for v in value], dtype=np.float64)
    except OverflowError:
        raise ValueError("an integer is too large for a float64") from None


def _bin_counts(value: Any) -> npt.NDArray[np.int64]:
    """One histogram's counts as int64, checked as a whole (see `_wire_float_array`)."""
    if not isinstance(value, list) or not set(map(type, value)) <= {int}:
        raise ValueError("counts must be arrays of integers")
    if len(value) > EXPONENT_HISTOGRAM_BINS:
        raise ValueError(f"a histogram has at most {EXPONENT_HISTOGRAM_BINS} bins")
    try:
        counts = np.array(value, dtype=np.int64)
    except OverflowError:
        raise ValueError("a count is too large for int64") from None
    if counts.size and counts.min() < 0:
        raise ValueError("counts must be >= 0")
    return counts


WireFloatArray = Annotated[npt.NDArray[np.float64], PlainValidator(_wire_float_array)]


def _lr_groups(value: Any) -> npt.NDArray[np.float64]:
    array = _wire_float_array(value)
    if not 1 <= array.size <= MAX_LR_GROUPS:
        raise ValueError(f"lr_groups holds 1 to {MAX_LR_GROUPS} values, got {array.size}")
    return array


LrGroups = Annotated[npt.NDArray[np.float64], PlainValidator(_lr_groups)]


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
    #: The grad norm after the loop's clip (`grad_norm` is before it); absent if none.
    grad_norm_clipped: WireFloat | None = None
    #: The final norm's input (the last block's output); absent if not measured.
    act_prenorm_mean: WireFloat | None = None
    act_prenorm_max: WireFloat | None = None
    #: Adam's second-moment lag and update/weight ratio, maxima over layers; absent if
    #: the optimizer is not Adam-family.
    adam_rms_max: WireFloat | None = None
    update_ratio_max: WireFloat | None = None
    #: Every param group's lr (wire `MAX_LR_GROUPS`); absent with a single group.
    lr_groups: LrGroups | None = None
    #: Sharded and unclipped: this rank's part of the squared global grad norm and how
    #: many ranks' parts make it (wire `MAX_GRAD_PARTS`); both or neither.
    grad_sumsq: WireFloat | None = None
    grad_parts: Annotated[int, Field(ge=1, le=MAX_GRAD_PARTS)] | None = None

    @model_validator(mode="after")
    def _grad_part(self) -> StepIn:
        if self.grad_sumsq is None and self.grad_parts is None:
            return self
        if self.grad_sumsq is None or self.grad_parts is None:
            raise ValueError("grad_sumsq and grad_parts come together")
        if self.rank >= self.grad_parts:
            raise ValueError("a grad_sumsq part's rank must be below grad_parts")
        sumsq = decode_float(self.grad_sumsq)
        if sumsq is not None and sumsq < 0:
            raise ValueError("grad_sumsq is a sum of squares: >= 0, NaN or Infinity")
        return self


BinCounts = Annotated[npt.NDArray[np.int64], PlainValidator(_bin_counts)]
ExponentBin = Annotated[int, Field(ge=0, lt=EXPONENT_HISTOGRAM_BINS)]


class ExponentHistogramsIn(_WireModel):
    """Per layer: counts[i][j] elements whose float32 exponent field is offsets[i] + j."""

    offsets: list[ExponentBin]
    counts: list[BinCounts]

    @model_validator(mode="after")
    def _within_bins(self) -> ExponentHistogramsIn:
        if len(self.offsets) != len(self.counts):
            raise ValueError("offsets and counts must have one entry per layer")
        for offset, counts in zip(self.offsets, self.counts):
            if offset + counts.size > EXPONENT_HISTOGRAM_BINS:
                raise ValueError(
                    f"a histogram from bin {offset} with {counts.size} counts passes bin "
                    f"{EXPONENT_HISTOGRAM_BINS - 1}"
                )
        return self


class ActivationsIn(_WireModel):
    """Per leaf module (`names`: module paths, not parameter names): activation max-abs."""

    names: list[Name]
    max_abs: WireFloatArray

    @model_validator(mode="after")
    def _aligned(self) -> ActivationsIn:
        if len(set(self.names)) != len(self.names):
            raise ValueError("activations.names must be unique")
        if self.max_abs.size != len(self.names):
            raise ValueError(
                f"activations.max_abs has {self.max_abs.size} values for {len(self.names)} "
                "names; send one per name, in the same order"
            )
        return self


class LayerStatsIn(_WireModel):
    """Statistics for several layers at one step; every array is aligned with `names`."""

    step: StepNumber
    rank: Rank = 0
    names: list[Name]
    stats: dict[str, WireFloatArray]
    exponent_histograms: ExponentHistogramsIn | None = None
    #: Stored as the statistic `ACTIVATION_STATS[0]` over the run's module list.
    activations: ActivationsIn | None = None

    @field_validator("stats")
    @classmethod
    def _known_stats(
        cls, stats: dict[str, npt.NDArray[np.float64]]
    ) -> dict[str, npt.NDArray[np.float64]]:
        unknown = sorted(set(stats) - set(PARAMETER_STATS))
        if unknown:
            raise ValueError(
                f"unknown statistic(s) {unknown}; this collector knows {LAYER_STATS} "
                "and wire.FP8_STATS (fp8_...)"
            )
        return stats

    @model_validator(mode="after")
    def _aligned(self) -> LayerStatsIn:
        if len(set(self.names)) != len(self.names):
            raise ValueError("names must be unique within one layer_stats record")
        for stat, values in self.stats.items():
            if values.size != len(self.names):
                raise ValueError(
                    f"stats[{stat!r}] has {values.size} values for {len(self.names)} names; "
                    "each array must hold one value per name, in the same order"
                )
        histograms = self.exponent_histograms
        if histograms is not None and len(histograms.offsets) != len(self.names):
            raise ValueError(
                f"exponent_histograms has {len(histograms.offsets)} histograms for "
                f"{len(self.names)} names; send one per name, in the same order"
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
        if _depth(data, MAX_DATA_DEPTH) > MAX_DATA_DEPTH:
            raise ValueError(f"data is nested deeper than {MAX_DATA_DEPTH} levels")
        # A JSON parser may accept NaN/Infinity literals; stored JSON must not contain them.
        return encode_nested(data)  # type: ignore[no-any-return]


class BatchIn(_WireModel):
    """One wire batch (layout: `ampwatch.agent.wire`)."""

    wire_version: int
    run: RunIn
    stream: Stream
    seq: Seq
    steps: list[StepIn] = Field(default_factory=list)
    layer_stats: list[LayerStatsIn] = Field(default_factory=list)
    events: list[EventIn] = Field(default_factory=list)
    dropped: dict[str, Annotated[int, Field(ge=0, le=MAX_BIGINT)]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _bounded(self) -> BatchIn:
        records = len(self.steps) + len(self.layer_stats) + len(self.events)
        if records > MAX_BATCH_RECORDS:
            raise ValueError(
                f"the batch holds {records} records, at most {MAX_BATCH_RECORDS}; send smaller "
                "batches"
            )
        names = {name for r in self.layer_stats for name in r.names}
        names.update(n for r in self.layer_stats if r.activations for n in r.activations.names)
        if len(names) > MAX_BATCH_LAYER_NAMES:
            raise ValueError(
                f"the batch names {len(names)} layers, at most {MAX_BATCH_LAYER_NAMES}; "
                "send fewer layers per batch"
            )
        values = sum(len(r.names) * max(1, len(r.stats)) for r in self.layer_stats)
        values += sum(len(r.activations.names) for r in self.layer_stats if r.activations)
        if values > MAX_BATCH_LAYER_VALUES:
            raise ValueError(
                f"the batch holds {values} layer values, at most {MAX_BATCH_LAYER_VALUES}; "
                "send fewer layers or steps per batch"
            )
        return self

    @field_validator("dropped")
    @classmethod
    def _known_dropped(cls, dropped: dict[str, int]) -> dict[str, int]:
        unknown = sorted(set(dropped) - set(DROPPED_KINDS))
        if unknown:
            raise ValueError(f"unknown dropped kind(s) {unknown}; expected {DROPPED_KINDS}")
        return dropped

    @field_validator("wire_version")
    @classmethod
    def _supported_version(cls, version: int) -> int:
        if version != WIRE_VERSION:
            raise ValueError(
                f"wire_version {version} is not supported: this collector speaks wire_version "
                f"{WIRE_VERSION}; run an agent and collector of matching releases"
            )
        return version


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of JSON-like `value` (a scalar is 0), counted no further than limit+1."""
    if limit < 0 or not isinstance(value, (dict, list)):
        return 0
    items = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(item, limit - 1) for item in items), default=0)
