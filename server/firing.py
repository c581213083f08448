"""The run's firing alerts, as the ingest acknowledgement carries them back to the agent.

The agent learns of an alert without a request of its own: every batch it posts is
answered with the run's firing alerts (`IngestAck.alerts`), read in the batch's own
transaction, so an alert that batch fired is in its answer. Every rank of a run posts to
the same run, so each hears the same alerts (`ampwatch.agent.policy`). One indexed read
(`alerts (run_id, status)`), bounded: critical first, then the latest fired.
"""

from __future__ import annotations

from sqlalchemy import case, select
from sqlalchemy.orm import Session

from ampwatch.server.models import Alert
from ampwatch.server.schemas.runs import AckAlert

#: At most this many alerts in one acknowledgement: a run with hundreds of per-layer
#: warnings firing still gets a small answer, its critical ones first.
MAX_ACK_ALERTS = 32


def firing_alerts(session: Session, run_id: int) -> list[AckAlert]:
    """The run's firing alerts, critical first, then by the step they fired at, latest first."""
    rows = session.execute(
        select(Alert.id, Alert.rule, Alert.layer, Alert.severity, Alert.fired_step)
        .where(Alert.run_id == run_id, Alert.status == "firing")
        .order_by(
            case((Alert.severity == "critical", 0), else_=1),
            Alert.fired_step.desc(),
            Alert.id.desc(),
        )
        .limit(MAX_ACK_ALERTS)
    ).all()
    return [
        AckAlert(id=id_, rule=rule, layer=layer, severity=severity, step=step)
        for id_, rule, layer, severity, step in rows
    ]
