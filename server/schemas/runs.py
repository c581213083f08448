"""Runs and what they hold: the ingest acknowledgement, runs, step series, layer
matrices and histograms, checkpoints and events (`ampwatch.server.api.runs`,
`ampwatch.server.api.run_data`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)

from ampwatch.agent.wire import (
    WireFloat,
)
from ampwatch.server.models import Health, RunStatus
from ampwatch.server.schemas.wire import Name


class AckAlert(BaseModel):
    """A firing alert of the run, as the ingest acknowledgement carries it to the agent."""

    id: int
    rule: str
    #: '' for a run-wide rule, else the layer a per-layer rule fired on.
    layer: str
    severity: str
    #: The step at which it fired (its `for` duration met).
    step: int | None


class IngestAck(BaseModel):
    run_id: int
    stream: str
    seq: int
    duplicate: bool
    #: The run's firing alerts after this batch, critical first (at most
    #: `ampwatch.server.firing.MAX_ACK_ALERTS`): the agent's `on_critical` policy reads them.
    alerts: list[AckAlert] = Field(default_factory=list)


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


class ActivationRuleLine(BaseModel):
    """What `activation_norm_spike` judges this run by (its effective settings)."""

    enabled: bool
    #: The step field it judges (`alerts.activation.judged_fields`: the first of them this
    #: answer holds), or null when the answer holds none.
    field: str | None
    min_ratio: float
    z_threshold: float
    baseline_steps: int
    min_baseline_steps: int


class ScaleRuleLines(BaseModel):
    """The loss-scale lines the rules judge this run by: `loss_scale_collapse.min_scale`,
    and, when the followed process's run_start reported its scaler's floor, that floor and
    `floor_headroom_octaves` above it (a skip below that line collapses at once)."""

    min_scale: float
    scaler_floor: float | None = None
    floor_headroom_octaves: int
    floor_headroom_scale: float | None = None


class AbandonedTail(BaseModel):
    """The steps one resume abandoned (recorded after `from_step`, the plan's checkpoint,
    before the run was resumed from it; `ampwatch.server.rollback`), ordered by step;
    floats in the wire encoding. `branch`: the run's resume it belongs to, from 1."""

    branch: int
    from_step: int
    step: list[int]
    skipped: list[bool]
    loss: list[WireFloat | None]
    loss_scale: list[WireFloat | None]
    grad_norm: list[WireFloat | None]


class AbandonedTails(BaseModel):
    """One rank's abandoned tails, oldest resume first; `left_off`: steps not sent (the
    answer's bound, `MAX_ABANDONED_STEPS`, keeps the newest resumes')."""

    tails: list[AbandonedTail]
    left_off: int = 0


class RuleLines(BaseModel):
    """The run's rule lines, resolved as the rule engine resolves its settings (run >
    project > alerts file > default: `ampwatch.server.alerts.config`), for the charts."""

    activation: ActivationRuleLine
    loss_scale: ScaleRuleLines


class StepSeries(BaseModel):
    """Columnar steps of one rank, ordered by step; floats in the wire encoding.

    With `bucket_width` > 1 the run was min/max-downsampled (`ampwatch.server.series`):
    each bucket of that many steps is two points, (first step, minima) and (last step,
    maxima); `skipped_count[i]` is the number of skipped steps point i stands for.

    `act_threshold[i]`: `activation_norm_spike`'s firing threshold, as the rule engine
    computed it at ingest, for the value it judged (`rule_lines.activation.field`); in a
    bucket, its minimum where a step was judged above it, else its maximum, so the bucket's
    maximum is above the line exactly when one of its steps was judged above
    (`act_above_count[i]`, on the bucket's first point). null where the rule judged
    nothing (off, warm-up calibration, a short baseline, a non-finite norm).
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
    #: The activation norm before the final norm; null where not measured (or before 0010).
    act_prenorm_mean: list[WireFloat | None]
    act_prenorm_max: list[WireFloat | None]
    adam_rms_max: list[WireFloat | None]
    update_ratio_max: list[WireFloat | None]
    skipped_count: list[int]
    bucket_width: int = 1
    #: Per point: every param group's lr, or null for a step with one group and for every
    #: point of a downsampled answer (`bucket_width` > 1).
    lr_groups: list[list[WireFloat] | None] = Field(default_factory=list)
    act_threshold: list[WireFloat | None] = Field(default_factory=list)
    act_above_count: list[int] = Field(default_factory=list)
    #: Null only from `ampwatch.server.series` alone; the endpoint always sets it.
    rule_lines: RuleLines | None = None


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
    #: The loss scale in effect at each histogram's step (the step record's, exact): the
    #: gradients were measured scaled by it. Null where no step record was stored.
    loss_scale: list[WireFloat | None] = []


class FullLayer(BaseModel):
    """One parameter's gradient figures over the whole tensor (`ampwatch.server.full_layers`).
    null: not measured (no histogram gives the shard sizes, or no rank sent it)."""

    layer: str
    #: Ranks whose record of this layer was combined.
    ranks: int
    numel: int | None
    zero_count: int | None
    zero_fraction: WireFloat | None
    subnormal_fraction: WireFloat | None
    flush_fraction: WireFloat | None
    max_abs_scaled: WireFloat | None
    #: The exponent histogram of the whole gradient: counts[j] elements with float32
    #: exponent field first_bin + j (wire `EXPONENT_HISTOGRAM_BINS`).
    first_bin: int | None
    counts: list[int] | None


class FullLayers(BaseModel):
    """A step's per-layer figures of the full gradients, combined over the ranks."""

    run_id: int
    step: int
    #: `run_start`'s sharding: "fsdp1", "fsdp2", or null (every rank the whole gradient).
    sharding: str | None
    #: "shards": the ranks' records added up; "replicated": the lowest rank's, as is.
    combined: str
    world_size: int | None
    replicas: int
    ranks: list[int]
    layers: list[FullLayer]


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
