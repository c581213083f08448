"""Alert lifecycle for one run within one transaction: pending -> firing -> resolved.

Evaluators report, per (rule, layer) and in step order, whether a condition holds
(`Tracker.holds`) or is clear (`Tracker.clear`). The tracker owns the run's open alerts
(loaded once per batch; the partial unique index `uq_alerts_open` allows one per key):

- holds, nothing open: a pending alert whose `started_step` is the condition's onset;
- pending and held `for_steps` since the onset: firing (notified);
- clear while pending: the pending alert is dropped, as Prometheus drops a pending alert
  that never fired: only alerts that fired are history;
- clear while firing for `resolve_steps` steps (hysteresis): resolved (notified).

Writes stay proportional to what changed, not to what is open (an alert storm on hundreds
of layers must not rewrite hundreds of rows per batch): a layer-scoped alert's message and
values are written when it transitions (created, fired, resolved, joined by another
layer), and then describe the sample of that transition; run-scoped alerts (at most one per
rule) are refreshed every batch in which their condition held, so a collapse's message
follows the scale.

Per-layer rules notify per incident, not per layer: while an alert of a layer-scoped rule
fires for a run, further layers of that rule that fire *join* it without a notification
(their values name the lead alert; the lead's message counts the layers affected), and the
resolution is notified, for the lead, when the last of them resolves. The groups live in
the run's step state (`groups`: rule -> {lead alert id, layers}).

`finish` writes those messages, flushes, enqueues notifications
(`ampwatch.server.outbox.enqueue`), keeps `Run.health`, and counts a change of the run
(`run_version.bump`) and of its alerts (`run_version.bump_alerts`) whenever it wrote any
of them: the alert lists are tagged and kept by the alerts counters (`api.conditional`),
and the sweep writes outside any ingest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from ampwatch.agent.wire import dumps
from ampwatch.server import outbox, run_version
from ampwatch.server.alerts.rule_settings import RuleSettings
from ampwatch.server.alerts.rules import INHIBITED_BY_COLLAPSE, RULES, SEVERITY_ORDER
from ampwatch.server.models import Alert, Run, Severity

#: A deferred (message, values) for an alert: built only when it is written.
Detail = Callable[[], tuple[str, dict[str, Any]]]
Key = tuple[str, str]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class OpenRow:
    """An open layer alert as read (no ORM object): what evaluation reads of it. The
    tracker loads the ORM row only for an alert that transitions (`Tracker._orm`)."""

    id: int
    run_id: int
    rule: str
    layer: str
    severity: str
    status: str
    started_step: int
    fired_step: int | None


def open_alerts(session: Session, run_id: int) -> list[Alert | OpenRow]:
    """The run's pending and firing alerts (bounded by rules x layers, never by steps):
    run-scoped ones (at most one per rule) as ORM objects, layer-scoped ones as `OpenRow`s.
    Loading hundreds of ORM objects with their JSON values per batch was most of an alert
    storm's cost, and a batch transitions few of them."""
    is_open = (Alert.run_id == run_id) & Alert.status.in_(("pending", "firing"))
    alerts: list[Alert | OpenRow] = list(
        session.scalars(select(Alert).where(is_open, Alert.layer == ""))
    )
    columns = (Alert.id, Alert.run_id, Alert.rule, Alert.layer, Alert.severity, Alert.status,
               Alert.started_step, Alert.fired_step)  # fmt: skip
    alerts += [
        OpenRow(*row) for row in session.execute(select(*columns).where(is_open, Alert.layer != ""))
    ]
    return alerts


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
        groups: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self.session = session
        self.run = run
        self.settings = settings
        self.now = now
        #: "rule|layer" -> first step of the current clear stretch of a firing alert.
        self.clear_since = clear_since
        #: layer-scoped rule -> {"lead": alert id, "layers": layers that fired} while any
        #: of its alerts fires (see the module docstring).
        self.groups: dict[str, dict[str, Any]] = groups if groups is not None else {}
        self.open: dict[Key, Alert | OpenRow] = {
            (a.rule, a.layer): a for a in open_alerts(session, run.id)
        }
        self._details: dict[Key, Detail] = {}
        self._changed: set[Key] = set()  # written in this batch (made, moved, rewritten)
        self._leads: dict[str, Alert] = {}  # leads that fired in this batch (no id yet)
        self._joined: list[tuple[str, Alert]] = []
        self._bulk: list[dict[str, Any]] = []  # resolutions of OpenRows, not yet written
        self._notify: list[tuple[Alert, outbox.Transition]] = []

    # -- what evaluators call ---------------------------------------------------------

    def is_open(self, rule: str, layer: str = "") -> bool:
        return (rule, layer) in self.open

    def open_layers(self, rule: str) -> list[str]:
        """Layers with an open alert of `rule` (a list: clearing may close some)."""
        return [layer for (name, layer) in self.open if name == rule and layer]

    def still_firing(self, rule: str, layer: str) -> bool:
        """`holds` for a layer alert that already fires, without building its message
        (which is not rewritten until its next transition): True when it applied."""
        alert = self.open.get((rule, layer))
        if alert is None or alert.status != "firing":
            return False
        if self.clear_since:
            self.clear_since.pop(f"{rule}|{layer}", None)
        return True

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
        severity: Severity | None = None,
        ready: bool = True,
    ) -> None:
        """The condition of (`rule`, `layer`) holds at `step`; its onset was `onset`.
        `ready=False` keeps a pending alert pending whatever `for_steps` says (a layer rule
        counts its `for_samples` itself)."""
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
            if self._bulk:  # a layer resolved earlier in this batch leaves the open index
                self._write_bulk()
            self.session.add(alert)
            self.open[key] = alert
            self._changed.add(key)
        elif severity is not None and SEVERITY_ORDER[severity] > SEVERITY_ORDER[alert.severity]:
            alert = self._orm(key)
            alert.severity = severity  # escalation: notified again if already firing
            self._changed.add(key)
            if alert.status == "firing":
                self._notify.append((alert, "firing"))
        self._details[key] = detail
        self.clear_since.pop(f"{rule}|{layer}", None)
        if alert.status == "pending":
            if rule in INHIBITED_BY_COLLAPSE and self.collapse_firing():
                return
            for_steps = int(getattr(self.settings[rule], "for_steps", 0))
            if ready and step - alert.started_step >= for_steps:
                alert = self._orm(key)
                alert.status = "firing"
                alert.fired_step = step
                alert.fired_at = self.now
                self._changed.add(key)
                self._fired(key, alert)

    def clear(self, rule: str, step: int, *, layer: str = "") -> None:
        """The condition of (`rule`, `layer`) does not hold at `step`."""
        alert = self.open.get((rule, layer))
        if alert is None:
            return
        if alert.status != "pending":  # a pending one goes at once (`resolve` drops it)
            since = self.clear_since.setdefault(f"{rule}|{layer}", step)
            if step - since < int(getattr(self.settings[rule], "resolve_steps", 0)):
                return
        self.resolve(rule, step, layer=layer)

    def clear_layers(self, rule: str, step: int, names: list[str], clear: Any) -> None:
        """`rule` is clear at `step` for the layers `names` where the boolean array `clear`
        is: tell the open ones (few; looping over every layer of a 500-layer record for
        nothing cost milliseconds)."""
        open_layers = self.open_layers(rule)
        if not open_layers:
            return
        position = {name: j for j, name in enumerate(names)}
        for layer in open_layers:
            j = position.get(layer)
            if j is not None and clear[j]:
                self.clear(rule, step, layer=layer)

    def resolve(self, rule: str, step: int, *, layer: str = "") -> None:
        """Resolve (`rule`, `layer`) now, whatever its hysteresis: the cause is gone."""
        key = (rule, layer)
        alert = self.open.get(key)
        if alert is None:
            return
        if alert.status == "pending":
            self._drop(key, alert)
            return
        resolved_step = max(step, alert.fired_step or step)
        self._changed.add(key)
        if isinstance(alert, OpenRow):  # written with the batch's other resolutions
            change: dict[str, Any] = {
                "id": alert.id,
                "status": "resolved",
                "resolved_step": resolved_step,
                "resolved_at": self.now,
            }
            detail = self._details.pop(key, None)
            if detail is not None:
                change["message"], change["values"] = self._rendered(key, alert, detail)
            self._bulk.append(change)
            alert.status = "resolved"
        else:
            self._apply_detail(key, alert)
            alert.status = "resolved"
            alert.resolved_step = resolved_step
            alert.resolved_at = self.now
        del self.open[key]
        self.clear_since.pop(f"{rule}|{layer}", None)
        self._resolved(rule, step, alert)

    def _write_bulk(self) -> None:
        """Resolutions of alerts read as OpenRow, in one executemany per set of columns
        (a storm that ends resolves hundreds of layers in one batch)."""
        by_columns: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        for change in self._bulk:
            by_columns.setdefault(tuple(change), []).append(change)
        self._bulk = []
        for rows in by_columns.values():
            self.session.execute(update(Alert), rows)

    # -- grouping of per-layer alerts -------------------------------------------------

    def _group_of(self, rule: str) -> bool:
        return RULES[rule].scope == "layer"

    def _fired(self, key: Key, alert: Alert) -> None:
        rule = key[0]
        if not self._group_of(rule):
            self._notify.append((alert, "firing"))
            return
        firing = any(
            a.status == "firing" for k, a in self.open.items() if k[0] == rule and k != key
        )
        group = self.groups.get(rule)
        if firing and group is not None:  # the incident is already paged: join it
            group["layers"] += 1
            self._joined.append((rule, alert))
            return
        self.groups[rule] = {"lead": None, "layers": 1}
        self._leads[rule] = alert
        self._notify.append((alert, "firing"))

    def _resolved(self, rule: str, step: int, alert: Alert | OpenRow) -> None:
        if self._group_of(rule):
            if any(a.status == "firing" for k, a in self.open.items() if k[0] == rule):
                return  # other layers of the incident still fire: resolved with the last
            group = self.groups.pop(rule, None) or {"lead": None, "layers": 1}
            lead_id = group["lead"] if group["lead"] is not None else alert.id
        else:
            group, lead_id = {"layers": 1}, alert.id
        lead = self._leads.pop(rule, None)
        if lead is None and isinstance(alert, Alert) and alert.id == lead_id:
            lead = alert
        if lead is None:  # the notification reads the row: one load per incident
            self._write_bulk()
            lead = self.session.get(Alert, lead_id, populate_existing=True)
            if lead is None:  # pragma: no cover - the run is locked; the lead cannot vanish
                return
        if group["layers"] > 1:
            lead.message = _group_message(lead.message, group["layers"])
            lead.values = {**(lead.values or {}), "layers_affected": group["layers"],
                           "group_resolved_step": step}  # fmt: skip
        self._notify.append((lead, "resolved"))

    # -- the end of the batch ---------------------------------------------------------

    def finish(self, last_step: int | None) -> None:
        """Drop or resolve alerts of disabled rules, write messages, notify, keep health."""
        for (rule, layer), alert in list(self.open.items()):
            if rule not in self.settings or not self.settings[rule].enabled:
                self.resolve(rule, last_step if last_step is not None else alert.started_step,
                             layer=layer)  # fmt: skip
        for key in list(self.open):
            if key in self._details and (key in self._changed or not self._group_of(key[0])):
                self._apply_detail(key, self._orm(key))
                self._changed.add(key)
        self._details.clear()
        self._write_bulk()
        stale = [k for k in self.clear_since if tuple(k.split("|", 1)) not in self.open]
        for k in stale:
            del self.clear_since[k]
        if self._notify or self._leads or self._joined:
            self.session.flush()  # notifications and groups refer to the alerts' ids
        for rule, lead in self._leads.items():
            if rule in self.groups:
                self.groups[rule]["lead"] = lead.id
        for rule, member in self._joined:
            group = self.groups.get(rule)
            if group is None or group["lead"] is None:
                continue
            member.values = {**(member.values or {}), "group_lead_id": group["lead"]}
            lead_key = next(
                (k for k, a in self.open.items() if k[0] == rule and a.id == group["lead"]),
                None,
            )
            if lead_key is not None:
                lead = self._orm(lead_key)
                lead.values = {**(lead.values or {}), "layers_affected": group["layers"]}
                lead.message = _group_message(lead.message, group["layers"])
        for alert, transition in self._notify:
            outbox.enqueue(self.session, alert, transition)
        self._count_changes()

    def _count_changes(self) -> None:
        """Keep the run's health, and count a change of the run when it or any alert moved,
        and of its alerts when any was written (the sweep writes outside any ingest)."""
        health = health_of(self.open.values())
        moved = self.run.health != health
        if moved:
            self.run.health = health  # type: ignore[assignment]
        if moved or self._changed:
            run_version.bump(self.run)
        if self._changed or self._leads or self._joined or self._notify:
            run_version.bump_alerts(self.session, self.run)

    def _apply_detail(self, key: Key, alert: Alert) -> None:
        detail = self._details.pop(key, None)
        if detail is not None:
            alert.message, alert.values = self._rendered(key, alert, detail)

    def _rendered(
        self, key: Key, alert: Alert | OpenRow, detail: Detail
    ) -> tuple[str, dict[str, Any]]:
        """The alert's message and values, with its group's (see the module docstring).
        Rendered and checked here, alert by alert, as strict JSON in the wire's encoding:
        a detail that fails costs its own alert its words, logged, never the batch's other
        alerts (a value the database refused at the flush once undid them all)."""
        try:
            message, values = detail()
            dumps(values)
        except Exception:
            logger.exception("alert %s|%s of run %s: its message could not be rendered",
                             key[0], key[1], self.run.id)  # fmt: skip
            message, values = f"{key[0]}: its details could not be rendered (logged)", {}
        group = self.groups.get(key[0])
        if group is not None and group["layers"] > 1 and group["lead"] == alert.id:
            message = _group_message(message, group["layers"])
            values = {**values, "layers_affected": group["layers"]}
        elif group is not None and group["lead"] is not None and group["lead"] != alert.id:
            values = {**values, "group_lead_id": group["lead"]}
        return message, values

    def _orm(self, key: Key) -> Alert:
        """The ORM object of open alert `key`, loaded now if it was read as an OpenRow."""
        alert = self.open[key]
        if isinstance(alert, OpenRow):
            loaded = self.session.get(Alert, alert.id)
            assert loaded is not None  # the run is locked: its alerts cannot vanish
            self.open[key] = alert = loaded
        return alert

    def _drop(self, key: Key, alert: Alert | OpenRow) -> None:
        del self.open[key]
        self._changed.add(key)
        self._details.pop(key, None)
        if isinstance(alert, OpenRow):
            self.session.execute(delete(Alert).where(Alert.id == alert.id))
        elif alert in self.session.new:
            self.session.expunge(alert)
        else:
            self.session.delete(alert)
            # Now, not at commit: the unit of work inserts before it deletes, and a new
            # pending alert of the same key in this batch would meet this row in the index.
            self.session.flush()


def _group_message(message: str, layers: int) -> str:
    """`message` of a group's lead alert, saying how many layers the incident reached."""
    suffix = " layers of this run affected]"
    base = message.rsplit(" [", 1)[0] if message.endswith(suffix) else message
    return f"{base} [{layers} layers of this run affected]"
