"""Feeding wire batches straight into `ingest_batch` (the alert engine runs inside it) and
reading back what the engine did: the alert tests' common helpers."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from wire_batches import make_batch, step_record

from ampwatch.agent.wire import LayerStatsRecord, StepRecord, encode_floats
from ampwatch.server.ingest import ingest_batch
from ampwatch.server.models import Alert, AlertState, Notification, Run, utcnow
from ampwatch.server.schemas.wire import BatchIn

T0 = datetime(2026, 1, 1, tzinfo=utcnow().tzinfo)


class Feed:
    """One run fed batch by batch; `now` advances one second per batch by default."""

    def __init__(self, sessions: sessionmaker[Session], client_run_id: str = "run-a") -> None:
        self.sessions = sessions
        self.client_run_id = client_run_id
        self.seq = 0
        self.now = T0

    def send(
        self,
        steps: Sequence[StepRecord] = (),
        layer_stats: Sequence[LayerStatsRecord] = (),
        events: Sequence[Any] = (),
        *,
        stream: str = "5eed",
        now: datetime | None = None,
    ) -> None:
        batch = make_batch(self.seq, client_run_id=self.client_run_id, stream=stream,
                           steps=list(steps), layer_stats=list(layer_stats),
                           events=list(events))  # fmt: skip
        self.seq += 1
        self.now = now or self.now + timedelta(seconds=1)
        with self.sessions() as session:
            ingest_batch(session, BatchIn.model_validate(batch), now=self.now)

    def send_steps(self, records: Sequence[StepRecord], per_batch: int = 100) -> None:
        for start in range(0, len(records), per_batch):
            self.send(records[start : start + per_batch])

    def alerts(self, **where: Any) -> list[Alert]:
        with self.sessions() as session:
            query = select(Alert).join(Run).where(Run.client_run_id == self.client_run_id)
            for column, value in where.items():
                query = query.where(getattr(Alert, column) == value)
            return list(session.scalars(query.order_by(Alert.id)))

    def rules(self, status: str = "firing") -> set[tuple[str, str]]:
        return {(a.rule, a.layer) for a in self.alerts(status=status)}

    def run(self) -> Run:
        with self.sessions() as session:
            return session.scalars(select(Run).where(Run.client_run_id == self.client_run_id)).one()

    def state(self, key: str = "steps") -> dict[str, Any]:
        with self.sessions() as session:
            row = session.get(AlertState, (self.run().id, key))
            return dict(row.data) if row is not None else {}

    def notifications(self) -> list[tuple[str, str]]:
        with self.sessions() as session:
            rows = session.execute(
                select(Alert.rule, Notification.transition)
                .join(Alert, Alert.id == Notification.alert_id)
                .order_by(Notification.id)
            )
            return [(rule, transition) for rule, transition in rows]


def healthy(
    first: int,
    count: int,
    *,
    scale: float = 4096.0,
    act: float = 10.0,
    loss: float = 2.0,
    skips: dict[int, float] | None = None,
) -> list[StepRecord]:
    """Clean steps with a constant scale and a slightly noisy act norm; `skips` maps a
    step to the (halved) scale it reports while being skipped."""
    records = []
    for step in range(first, first + count):
        wobble = 0.02 * ((step * 7919) % 11 - 5) / 5  # deterministic +-2% noise
        skipped = skips is not None and step in skips
        records.append(
            step_record(
                step,
                skipped=skipped,
                loss=loss * (1 + wobble),
                loss_scale=skips[step] if skips and skipped else scale,
                act_norm_mean=act * (1 + wobble),
                act_norm_max=2 * act * (1 + wobble),
            )
        )
    return records


def calibration(first: int = 1, *, start: float = 65536.0, halvings: int = 4) -> list[StepRecord]:
    """GradScaler's warm-up: skipped steps halving the scale from `start`."""
    return [
        step_record(
            first + i,
            skipped=True,
            loss=2.5,
            loss_scale=start / 2**i,
            act_norm_mean=10.0,
            act_norm_max=20.0,
        )
        for i in range(halvings)
    ]


def layer_sample(
    step: int,
    values: dict[str, float],
    *,
    stat: str = "zero_fraction",
    rank: int = 0,
    extra: dict[str, dict[str, float]] | None = None,
) -> LayerStatsRecord:
    names = list(values)
    stats = {stat: encode_floats([values[n] for n in names])}
    for other, by_name in (extra or {}).items():
        stats[other] = encode_floats([by_name[n] for n in names])
    return {"step": step, "rank": rank, "names": names, "stats": stats}


def finding(code: str, step: int | None = None, message: str = "") -> dict[str, Any]:
    return {"kind": "finding", "step": step, "time": 1_767_225_600.0,
            "data": {"code": code, "message": message or code}}  # fmt: skip
