"""The restart advisor's answer (`ampwatch.server.advisor`)."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
)

from ampwatch.agent.wire import (
    WireFloat,
)

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
