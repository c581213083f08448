"""Alert lifecycle for one run within one transaction: pending -> firing -> resolved.

Evaluators report, per (rule, layer) and in step order, whether a condition holds
(`Tracker.holds`) or is clear (`Tracker.clear`). The tracker owns the run's open alerts
(loaded once per batch; the partial unique index `uq_alerts_open` allows one per key):

- holds, nothing open: a pending alert whose `started_step` is the condition's onset;
- pending and held `for_steps` since the onset: firing (notified);
- clear while pending: the pending alert is dropped, as Prometheus drops a pending alert
  that never fired: only alerts that fired are history;
- clear while firing for `resolve_steps` steps (hysteresis): resolved (notified).

`finish` refreshes the messages of alerts whose condition held in this batch, flushes,
enqueues notifications (`ampwatch.server.notify.enqueue`) and keeps `Run.health`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.server import notify
from ampwatch.server.alerts.rules import INHIBITED_BY_COLLAPSE, RULES, SEVERITY_ORDER, RuleSettings
from ampwatch.server.models import Alert, Run

#: A deferred (message, values) for an alert: built only when it is written.
Detail = Callable[[], tuple[str, dict[str, Any]]]
Key = tuple[str, str]


def open_alerts(session: Session, run_id: int) -> list[Alert]:
    """The run's pending and firing alerts (bounded by rules x layers, never by steps)."""
    return list(
        session.scalars(
            select(Alert).where(Alert.run_id == run_id, Alert.status.in_(("pending", "firing")))
        )
    )


def health_of(alerts: Any) -> str:
    """Worst severity among firing alerts; 'ok' when none (an info alert counts as ok)."""
    worst = "ok"
    for alert in alerts:
        firing = alert.status == "firing" and alert.severity in ("warning", "critical")
        if firing and (worst == "ok" or SEVERITY_ORDER[alert.severity] > SEVERITY_ORDER[worst]):
            worst = alert.severity
    return worst


class Tracker:
    """Transitions of one run's alerts for one batch; see the module docstring."""

    def __init__(
        self,
        session: Session,
        run: Run,
        settings: dict[str, RuleSettings],
        *,
        now: datetime,
        clear_since: dict[str, int],
    ) -> None:
        self.session = session
        self.run = run
        self.settings = settings
        self.now = now
        #: "rule|layer" -> first step of the current clear stretch of a firing alert.
        self.clear_since = clear_since
        self.open: dict[Key, Alert] = {(a.rule, a.layer): a for a in open_alerts(session, run.id)}
        self._details: dict[Key, Detail] = {}
        self._notify: list[tuple[Alert, notify.Transition]] = []

    # -- what evaluators call ---------------------------------------------------------

    def is_open(self, rule: str, layer: str = "") -> bool:
        return (rule, layer) in self.open

    def open_layers(self, rule: str) -> list[str]:
        """Layers with an open alert of `rule` (a list: clearing may close some)."""
        return [layer for (name, layer) in self.open if name == rule and layer]

    def collapse_firing(self) -> bool:
        alert = self.open.get(("loss_scale_collapse", ""))
        return alert is not None and alert.status == "firing"

    def holds(
        self,
        rule: str,
        step: int,
        detail: Detail,
        *,
        layer: str = "",
        onset: int | None = None,
        severity: str | None = None,
    ) -> None:
        """The condition of (`rule`, `layer`) holds at `step`; its onset was `onset`."""
        key = (rule, layer)
        alert = self.open.get(key)
        if alert is None:
            if rule in INHIBITED_BY_COLLAPSE and self.collapse_firing():
                return  # one incident, one page: the collapse explains the underflow
            alert = Alert(
                run_id=self.run.id,
                rule=rule,
                layer=layer,
                severity=severity or RULES[rule].severity,
                status="pending",
                started_step=min(step, onset) if onset is not None else step,
                started_at=self.now,
                message="",
                values={},
            )
            self.session.add(alert)
            self.open[key] = alert
        elif severity is not None and SEVERITY_ORDER[severity] > SEVERITY_ORDER[alert.severity]:
            alert.severity = severity  # escalation: notified again if already firing
            if alert.status == "firing":
                self._notify.append((alert, "firing"))
        self._details[key] = detail
        self.clear_since.pop(f"{rule}|{layer}", None)
        if alert.status == "pending":
            if rule in INHIBITED_BY_COLLAPSE and self.collapse_firing():
                return
            for_steps = int(getattr(self.settings[rule], "for_steps", 0))
            if step - alert.started_step >= for_steps:
                alert.status = "firing"
                alert.fired_step = step
                alert.fired_at = self.now
                self._notify.append((alert, "firing"))

    def clear(self, rule: str, step: int, *, layer: str = "") -> None:
        """The condition of (`rule`, `layer`) does not hold at `step`."""
        key = (rule, layer)
        alert = self.open.get(key)
        if alert is None:
            return
        if alert.status == "pending":
            self._drop(key, alert)
            return
        since = self.clear_since.setdefault(f"{rule}|{layer}", step)
        resolve_steps = int(getattr(self.settings[rule], "resolve_steps", 0))
        if step - since >= resolve_steps:
            self.resolve(rule, step, layer=layer)

    def resolve(self, rule: str, step: int, *, layer: str = "") -> None:
        """Resolve (`rule`, `layer`) now, whatever its hysteresis: the cause is gone."""
        key = (rule, layer)
        alert = self.open.get(key)
        if alert is None:
            return
        if alert.status == "pending":
            self._drop(key, alert)
            return
        self._apply_detail(key, alert)
        alert.status = "resolved"
        alert.resolved_step = max(step, alert.fired_step or step)
        alert.resolved_at = self.now
        del self.open[key]
        self.clear_since.pop(f"{rule}|{layer}", None)
        self._notify.append((alert, "resolved"))

    # -- the end of the batch ---------------------------------------------------------

    def finish(self, last_step: int | None) -> None:
        """Drop or resolve alerts of disabled rules, write messages, notify, keep health."""
        for (rule, layer), alert in list(self.open.items()):
            if rule not in self.settings or not self.settings[rule].enabled:
                self.resolve(rule, last_step if last_step is not None else alert.started_step,
                             layer=layer)  # fmt: skip
        for key, alert in self.open.items():
            self._apply_detail(key, alert)
        stale = [k for k in self.clear_since if tuple(k.split("|", 1)) not in self.open]
        for k in stale:
            del self.clear_since[k]
        if self._notify:
            self.session.flush()  # notifications refer to the alerts' ids
            for alert, transition in self._notify:
                notify.enqueue(self.session, alert, transition)
        health = health_of(self.open.values())
        if self.run.health != health:
            self.run.health = health  # type: ignore[assignment]

    def _apply_detail(self, key: Key, alert: Alert) -> None:
        detail = self._details.pop(key, None)
        if detail is not None:
            alert.message, alert.values = detail()

    def _drop(self, key: Key, alert: Alert) -> None:
        del self.open[key]
        self._details.pop(key, None)
        if alert in self.session.new:
            self.session.expunge(alert)
        else:
            self.session.delete(alert)
            # Now, not at commit: the unit of work inserts before it deletes, and a new
            # pending alert of the same key in this batch would meet this row in the index.
            self.session.flush()
