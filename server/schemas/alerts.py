"""Alerts, their rules and per-run/project configuration (`ampwatch.server.alerts`,
`ampwatch.server.api.alerts`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ampwatch.server.models import AlertStatus, Severity


class AlertPublic(BaseModel):
    """One alert: `layer` is '' for run-level rules; steps say when in training (onset,
    firing, resolution), times (Unix seconds) when the collector saw it; `message` explains
    the firing in words, `values` has its numbers. Read from an `Alert` row
    (`AlertPublic.model_validate(alert)`)."""

    model_config = ConfigDict(from_attributes=True)

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

    @field_validator("started_at", "fired_at", "resolved_at", mode="before")
    @classmethod
    def _unix_seconds(cls, moment: Any) -> Any:
        return moment.timestamp() if isinstance(moment, datetime) else moment

    @field_validator("values", mode="before")
    @classmethod
    def _no_values(cls, values: Any) -> Any:
        return {} if values is None else values


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
