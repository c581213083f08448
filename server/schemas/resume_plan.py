"""The resume plan (`ampwatch.server.resume_plan`): what a relaunch script applies."""

from __future__ import annotations

from pydantic import BaseModel

from ampwatch.agent.wire import WireFloat
from ampwatch.server.schemas.advisor import DataSkip


class PlanCheckpoint(BaseModel):
    """The advisor's recommended checkpoint, with the reasons it is healthy."""

    step: int | None
    path: str | None
    time: float
    reasons: list[str]
    loss_scale: WireFloat | None
    act_norm: WireFloat | None


class BatchRange(BaseModel):
    """Batches of one epoch to skip, inclusive, as the run reported its data position."""

    epoch: int
    start: int
    end: int


class PlanSkip(DataSkip):
    """The data to skip on restart: the steps (inclusive), and the batches those steps
    consumed when the run reported its data position (`handle.data_position`)."""

    batches: list[BatchRange]
    #: The batch indices (`batch_idx`) to skip, as Lightning Fabric's `skip_batches.json`
    #: lists them; null when the steps span several epochs, or more than `MAX_SKIP_BATCHES`.
    skip_batches: list[int] | None
    #: Steps in the range whose data position the run did not report.
    steps_without_position: int


class PlanAdvice(BaseModel):
    """A setting to change on restart: `setting` is `lr`, `init_scale`, `growth_interval`
    or `precision`; `value` what to set it to; `reason` why, with the values."""

    setting: str
    value: float | int | str
    reason: str


class ResumePlan(BaseModel):
    """Where to restart a run from, what data to skip and what to change: a relaunch
    script passes it to `watch(resume_from=plan)`, which continues `client_run_id`."""

    run_id: int
    client_run_id: str
    name: str
    project: str
    #: True when a healthy checkpoint is recommended; else `why` says what is missing.
    ready: bool
    why: str
    onset_step: int | None
    onset_rule: str | None
    checkpoint: PlanCheckpoint | None
    skip: PlanSkip | None
    advice: list[PlanAdvice]
    #: The run's firing alerts when the plan was made: a resumed process resolves them
    #: (they belong to the abandoned steps), and its policy does not act on them again.
    firing_alert_ids: list[int]
