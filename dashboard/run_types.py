"""A run's summary, events, alerts and restart advice as the collector answers them,
decoded (`CollectorClient` reads them); each turns back into the API's JSON shape for a
`dcc.Store`, NaN kept (`ampwatch.dashboard.series_types` says why).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ampwatch.agent.wire import decode_float, encode_float


@dataclass(frozen=True)
class RunSummary:
    """One row of `GET /runs` (the API's `RunPublic`)."""

    id: int
    client_run_id: str
    name: str
    project: str
    status: str
    created_at: str
    last_seen_at: str
    steps: int
    last_step: int | None
    last_loss_scale: float | None
    skipped_steps: int
    #: 'ok' | 'warning' | 'critical': the worst firing alert (kept by the alert engine).
    health: str = "ok"
    #: Skipped share over the run's last ~1,024 steps (the collector's recent rollups).
    skip_rate: float | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSummary:
        return cls(
            id=int(data["id"]),
            client_run_id=str(data["client_run_id"]),
            name=str(data["name"]),
            project=str(data["project"]),
            status=str(data["status"]),
            created_at=str(data["created_at"]),
            last_seen_at=str(data["last_seen_at"]),
            steps=int(data["steps"]),
            last_step=data.get("last_step"),
            last_loss_scale=decode_float(data.get("last_loss_scale")),
            skipped_steps=int(data["skipped_steps"]),
            health=str(data.get("health") or "ok"),
            skip_rate=data.get("skip_rate"),
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "last_loss_scale": encode_float(self.last_loss_scale)}


@dataclass(frozen=True)
class RunEvent:
    """One entry of `GET /runs/{id}/events` (run start, checkpoint, run end, finding)."""

    kind: str
    step: int | None
    time: float
    data: dict[str, Any]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunEvent:
        return cls(
            kind=str(data["kind"]),
            step=data.get("step"),
            time=float(data["time"]),
            data=dict(data.get("data") or {}),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Alert:
    """One alert of `GET /runs/{id}/alerts` (the alert engine's contract)."""

    id: int
    rule: str
    layer: str | None
    severity: str
    status: str  # 'pending' | 'firing' | 'resolved'
    started_step: int | None
    fired_step: int | None
    resolved_step: int | None
    started_at: float | None  # Unix seconds, when the collector saw it
    fired_at: float | None
    resolved_at: float | None
    message: str
    values: dict[str, Any]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Alert:
        return cls(
            id=int(data["id"]),
            rule=str(data["rule"]),
            layer=data.get("layer") or None,  # '' (or null) for a run-level rule
            severity=str(data.get("severity") or "warning"),
            status=str(data.get("status") or "firing"),
            started_step=data.get("started_step"),
            fired_step=data.get("fired_step"),
            resolved_step=data.get("resolved_step"),
            started_at=data.get("started_at"),
            fired_at=data.get("fired_at"),
            resolved_at=data.get("resolved_at"),
            message=str(data.get("message") or ""),
            values=dict(data.get("values") or {}),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RestartCandidate:
    """A checkpoint as the restart advisor judged it."""

    step: int | None
    path: str | None
    time: Any
    verdict: str  # 'recommended' | 'healthy' | 'rejected'
    reasons: list[str]
    loss_scale: float | None
    act_norm: float | None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RestartCandidate:
        return cls(
            step=data.get("step"),
            path=data.get("path"),
            time=data.get("time"),
            verdict=str(data.get("verdict") or ""),
            reasons=[str(r) for r in data.get("reasons") or []],
            loss_scale=decode_float(data.get("loss_scale")),
            act_norm=decode_float(data.get("act_norm")),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "loss_scale": encode_float(self.loss_scale),
            "act_norm": encode_float(self.act_norm),
        }


@dataclass(frozen=True)
class RestartAdvice:
    """`GET /runs/{id}/restart-candidates`: the advisor's ranking of the run's checkpoints."""

    onset_step: int | None
    onset_rule: str | None
    margin_steps: int | None
    recommended_step: int | None
    candidates: list[RestartCandidate]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RestartAdvice:
        recommended = data.get("recommended") or {}
        return cls(
            onset_step=data.get("onset_step"),
            onset_rule=data.get("onset_rule"),
            margin_steps=data.get("margin_steps"),
            recommended_step=recommended.get("step"),
            candidates=[RestartCandidate.from_json(c) for c in data.get("candidates") or []],
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "onset_step": self.onset_step,
            "onset_rule": self.onset_rule,
            "margin_steps": self.margin_steps,
            "recommended": None
            if self.recommended_step is None
            else {"step": self.recommended_step},
            "candidates": [c.to_json() for c in self.candidates],
        }
