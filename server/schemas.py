"""HTTP request and response models, named by role.

Field names, statistic names, event kinds and the non-finite float encoding all come from
`ampwatch.agent.wire`, the one contract between agent and collector. Incoming models are
strict (no "1.5" strings for numbers, no 0/1 for booleans) and forbid unknown fields, so an
agent bug is answered with a 422 that names the field instead of being half-understood.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal

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
    MAX_LR_GROUPS,
    MAX_NAME_LENGTH,
    NON_FINITE,
    PARAMETER_STATS,
    STREAM_MAX_LENGTH,
    STREAM_PATTERN,
    WIRE_VERSION,
    WireFloat,
    encode_float,
)
from ampwatch.server.models import AlertStatus, Health, RunStatus, Severity, WebhookFormat

#: Largest value that fits the BIGINT step and seq columns.
MAX_BIGINT = 2**63 - 1
#: Largest value that fits an INTEGER column (ranks).
MAX_INT = 2**31 - 1
#: Event times are Unix seconds; this bound (year 9999) keeps them convertible to datetime.
MAX_EVENT_TIME = 253_402_300_799.0
#: Most records (steps + layer_stats + events) in one batch (the agent seals at 2,000; the
#: body limit allows ~200k steps), and
#: most layer values (names x statistics, over its layer_stats): a batch is one
#: transaction, and on SQLite one writer at a time: a batch of 1M new layer names held the
#: write lock for 39 s (1.66 GB peak), and another tenant's batch failed meanwhile.
MAX_BATCH_RECORDS = 50_000
MAX_BATCH_LAYER_VALUES = 2_000_000
#: Most distinct layer (and module) names in one batch: new names are the costly part.
MAX_BATCH_LAYER_NAMES = 65_536
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
    #: Every param group's lr (wire `MAX_LR_GROUPS`); absent with a single group.
    lr_groups: LrGroups | None = None


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
        return _encode_non_finite(data)  # type: ignore[no-any-return]


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


def _encode_non_finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return encode_float(value)
    if isinstance(value, dict):
        return {key: _encode_non_finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_encode_non_finite(item) for item in value]
    return value


class ErrorPublic(BaseModel):
    """An error answer: `detail` says what was wrong and how to fix it."""

    detail: str


class IngestAck(BaseModel):
    run_id: int
    stream: str
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
    #: Worst severity among the run's firing alerts ('ok' when none fires).
    health: Health = "ok"
    #: Share of skipped steps over the run's last `SKIP_RATE_BUCKETS` step rollups (up to
    #: 1,024 steps, all ranks); null before any step.
    skip_rate: float | None = None
    #: Records the agent dropped rather than block training, by kind (wire DROPPED_KINDS):
    #: non-zero means the charts have gaps the agent knows about.
    dropped: dict[str, int] = Field(default_factory=dict)


class RunsPublic(BaseModel):
    """One page of runs, newest first: `total` runs match, this page starts at `offset`."""

    runs: list[RunPublic]
    total: int
    limit: int
    offset: int


class RunCreate(BaseModel):
    """Create a run, or resume the run with this `client_run_id` (idempotent).

    `project` defaults to the token's project (`default` without a project token).
    """

    model_config = ConfigDict(extra="forbid")

    client_run_id: Name
    name: Name
    project: Name | None = None


class RunEnd(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: Name | None = None


class StepSeries(BaseModel):
    """Columnar steps of one rank, ordered by step; floats in the wire encoding.

    With `bucket_width` > 1 the run was min/max-downsampled (`ampwatch.server.series`):
    each bucket of that many steps is two points, (first step, minima) and (last step,
    maxima); `skipped_count[i]` is the number of skipped steps point i stands for.
    """

    step: list[int]
    loss: list[WireFloat | None]
    loss_scale: list[WireFloat | None]
    skipped: list[bool]
    grad_norm: list[WireFloat | None]
    lr: list[WireFloat | None]
    act_norm_mean: list[WireFloat | None]
    act_norm_max: list[WireFloat | None]
    #: The grad norm after the loop's clip; null where it did not clip (or before 0009).
    grad_norm_clipped: list[WireFloat | None]
    skipped_count: list[int]
    bucket_width: int = 1
    #: Per point: every param group's lr, or null for a step with one group and for every
    #: point of a downsampled answer (`bucket_width` > 1).
    lr_groups: list[list[WireFloat] | None] = Field(default_factory=list)


class LayerMatrix(BaseModel):
    """One statistic as a steps x layers matrix (`values[i][j]`: steps[i], layers[j]).

    null: the layer was not in that step's record; "NaN": the statistic itself was NaN.
    """

    stat: str
    layers: list[str]
    steps: list[int]
    values: list[list[WireFloat | None]]
    #: >1 when downsampled: a row is the max over `step_width` steps from `steps[i]`, a
    #: column the max over `layer_width` consecutive layers from `layers[j]`.
    step_width: int = 1
    layer_width: int = 1


class LayerSeries(BaseModel):
    """One layer's statistic over steps, downsampled as `StepSeries` (`bucket_width`)."""

    layer: str
    stat: str
    rank: int
    step: list[int]
    value: list[WireFloat | None]
    bucket_width: int = 1


class LayerHistograms(BaseModel):
    """One layer's exponent histograms, as on the wire: counts[i][j] is the number of
    gradient elements at steps[i] whose float32 exponent field is offsets[i] + j."""

    layer: str
    rank: int
    steps: list[int]
    offsets: list[int]
    counts: list[list[int]]


class CheckpointPublic(BaseModel):
    """A `checkpoint` event: the step saved, when, where (`path`, when the agent said)."""

    step: int | None
    time: float
    path: str | None
    data: dict[str, Any]


class CheckpointsPublic(BaseModel):
    checkpoints: list[CheckpointPublic]


class EventPublic(BaseModel):
    """An event as the agent sent it; `time` in Unix seconds, as on the wire."""

    kind: str
    step: int | None
    time: float
    data: dict[str, Any]


class EventsPublic(BaseModel):
    events: list[EventPublic]


# --- webhooks (`ampwatch.server.api.webhooks`) --------------------------------------------

#: Longest webhook URL stored (`webhooks.url`).
MAX_URL_LENGTH = 2048


class WebhookCreate(BaseModel):
    """A webhook to post alert transitions to.

    `project`: whose alerts; a project token may name only its own (the default for it),
    an admin may omit it for every project's. `min_severity`: the least severe alert sent.
    """

    model_config = ConfigDict(extra="forbid")

    url: str
    format: WebhookFormat = "generic"
    project: Name | None = None
    min_severity: Severity = "warning"

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        from urllib.parse import urlsplit

        url = url.strip()
        if len(url) > MAX_URL_LENGTH:
            raise ValueError(f"url is longer than {MAX_URL_LENGTH} characters")
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises ValueError on a malformed port
        except ValueError as error:
            raise ValueError(f"url is not a valid URL: {error}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("url must be an http:// or https:// URL with a host")
        if any(ch.isspace() or ord(ch) < 32 for ch in url):
            raise ValueError("url must not contain spaces or control characters")
        return url


class WebhookPublic(BaseModel):
    id: int
    url: str
    format: WebhookFormat
    #: null: every project's alerts (created by an admin).
    project: str | None
    min_severity: Severity
    enabled: bool
    created_at: datetime


class WebhooksPublic(BaseModel):
    webhooks: list[WebhookPublic]


class DeliveryPublic(BaseModel):
    """One notification to a webhook: its delivery state and last attempt's outcome."""

    id: int
    alert_id: int
    run_id: int
    rule: str
    severity: Severity
    transition: str
    status: str
    attempts: int
    next_attempt_at: datetime
    last_error: str | None
    response_status: int | None
    created_at: datetime
    delivered_at: datetime | None


class DeliveriesPublic(BaseModel):
    """A webhook's delivery log, newest first."""

    deliveries: list[DeliveryPublic]


class WebhookTestResult(BaseModel):
    """What the webhook answered to a test message (sent at once, not queued)."""

    delivered: bool
    response_status: int | None
    error: str | None


# --- restart advisor (`ampwatch.server.advisor`) --------------------------------------

Verdict = Literal["recommended", "healthy", "rejected"]


class RestartCheckpoint(BaseModel):
    step: int | None
    path: str | None
    #: When the agent reported it saved, Unix seconds (as `/checkpoints`).
    time: float


class RestartCandidate(RestartCheckpoint):
    """A checkpoint judged: `reasons` say why, with the values, for every verdict."""

    verdict: Verdict
    reasons: list[str]
    #: The loss scale and the final-layer activation norm (mean over tokens) at its step.
    loss_scale: WireFloat | None
    act_norm: WireFloat | None


class DataSkip(BaseModel):
    """Steps of data worth skipping on a restart from the recommended checkpoint (inclusive)."""

    start: int
    end: int
    reason: str


class RestartCandidates(BaseModel):
    """A run's checkpoints ranked for a restart: the recommended one first, then the
    other healthy ones, latest first, then the rejected ones, latest first."""

    run_id: int
    #: First step of the first incident that reached critical (its earliest precursor).
    onset_step: int | None
    onset_rule: str | None
    #: How far before the onset a checkpoint must be to count as healthy.
    margin_steps: int
    recommended: RestartCheckpoint | None
    candidates: list[RestartCandidate]
    #: With a recommendation and an incident: the data to skip when restarting from it.
    skip_steps: DataSkip | None = None


# --- alerts (`ampwatch.server.alerts`, `ampwatch.server.api.alerts`) ----------------------


class AlertPublic(BaseModel):
    """One alert: `layer` is '' for run-level rules; steps say when in training (onset,
    firing, resolution), times (Unix seconds) when the collector saw it; `message` explains
    the firing in words, `values` has its numbers."""

    id: int
    run_id: int
    rule: str
    layer: str
    severity: Severity
    status: AlertStatus
    started_step: int
    fired_step: int | None
    resolved_step: int | None
    started_at: float
    fired_at: float | None
    resolved_at: float | None
    message: str
    values: dict[str, Any]


class AlertsPublic(BaseModel):
    """One page of alerts, newest first: `total` match, this page starts at `offset`."""

    alerts: list[AlertPublic]
    total: int
    limit: int
    offset: int


class AlertRulePublic(BaseModel):
    """A rule: `scope` 'layer' for per-layer rules; `defaults` its built-in settings,
    `settings` what each one means."""

    name: str
    severity: Severity
    scope: Literal["run", "layer"]
    description: str
    defaults: dict[str, Any]
    settings: dict[str, str]


class AlertRulesPublic(BaseModel):
    rules: list[AlertRulePublic]


class AlertConfigIn(BaseModel):
    """Threshold overrides for a project or a run: {rule: {setting: value}}. A PUT
    replaces the scope's overrides; `{"rules": {}}` clears them."""

    model_config = ConfigDict(extra="forbid")

    rules: dict[str, dict[str, Any]] = Field(default_factory=dict)


class AlertConfigPublic(BaseModel):
    """A scope's overrides (`rules`) and every rule's `effective` settings there
    (run > project > the collector's alerts file > defaults)."""

    project: str
    run_id: int | None
    rules: dict[str, dict[str, Any]]
    effective: dict[str, dict[str, Any]]
    updated_at: float | None
