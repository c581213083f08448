"""Run a catalog scenario against a collector and judge what its alert engine and restart
advisor said, against the scenario's label. Shared by `test_scenarios.py` and
`bench/detection.py` (imported by file name, as `scenario_catalog`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from scenario_catalog import Label, Observed, Scenario, ground_truth, observe, train

#: Rules that describe an incident's course (not configuration findings such as
#: fp16_without_scaler or clip_before_unscale, which fire at the first step by design).
INCIDENT_RULES = frozenset({
    "loss_scale_collapse", "skip_rate", "activation_norm_spike", "silent_underflow",
    "underflow_risk", "scale_floor_stall", "nan_loss", "loss_spike", "grad_norm_spike",
    "overflow_burst", "loss_collapse",
})  # fmt: skip
SEVERITIES = ("info", "warning", "critical")


@dataclass
class Outcome:
    """One scenario's run, its ground truth, and what the collector concluded."""

    scenario: Scenario
    label: Label
    obs: Observed
    signal_problems: list[str]
    alerts: list[dict[str, Any]] | None = None  # None until read (`read_alerts`)
    advisor: dict[str, Any] | None = None  # None: the restart-candidates endpoint does not
    train_seconds: float = 0.0
    problems: list[str] = field(default_factory=list)  # alert/advisor expectations missed

    # --- derived -------------------------------------------------------------------------

    @property
    def fired(self) -> list[dict[str, Any]]:
        """Alerts that reached `firing` (still firing or since resolved); pending ones did
        not page anyone."""
        return [a for a in self.alerts or [] if a.get("fired_step") is not None
                or a.get("status") == "firing"]  # fmt: skip

    @property
    def fired_rules(self) -> set[str]:
        return {a["rule"] for a in self.fired}

    def false_alerts(self) -> dict[str, list[str]]:
        """Fired alerts the label neither requires nor allows, by severity."""
        allowed = self.label.must_fire | self.label.may_fire
        out: dict[str, list[str]] = {}
        for a in self.fired:
            if a["rule"] not in allowed:
                name = a["rule"] + (f"[{a['layer']}]" if a.get("layer") else "")
                out.setdefault(a["severity"], []).append(name)
        return out

    def first_step(self, rules: set[str] | frozenset[str]) -> int | None:
        steps = [_fired_step(a) for a in self.fired if a["rule"] in rules]
        steps = [s for s in steps if s is not None]
        return min(steps) if steps else None

    def lead_time(self) -> int | None:
        """Steps from the incident's first fired alert to the scale falling below 1.0, or
        (no collapse) to the first frozen layer; negative when the alert came later."""
        first = self.first_step(self.label.must_fire & INCIDENT_RULES)
        target = self.label.collapse_step or self.label.first_frozen_step
        if first is None or target is None:
            return None
        return target - first

    def collapse_alert_step(self) -> int | None:
        return self.first_step({"loss_scale_collapse"})

    def advisor_pick(self) -> int | None:
        if not self.advisor or not self.advisor.get("recommended"):
            return None
        return int(self.advisor["recommended"]["step"])


def _fired_step(alert: dict[str, Any]) -> int | None:
    step = alert.get("fired_step")
    if step is None:
        step = alert.get("started_step")
    return None if step is None else int(step)


def _get_json(api: httpx.Client, path: str) -> Any:
    """JSON of `path`; any error answer fails the scenario (a missing alerts route too:
    the engine is what the scenarios judge)."""
    response = api.get(path)
    response.raise_for_status()
    return response.json()


def read_alerts(api: httpx.Client, run_id: str) -> list[dict[str, Any]]:
    """The run's alerts, read once: the rules run in the transaction that stores each batch,
    and `observe` has already seen the run's end stored after its last step, so nothing is
    left to catch up with."""
    return list(_get_json(api, f"/api/v1/runs/{run_id}/alerts")["alerts"])


def run_scenario(scenario: Scenario, url: str, workdir: Path) -> Outcome:
    """Train `scenario` into the collector at `url` and judge the result."""
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    client_run_id = train(scenario, url, workdir)
    seconds = time.monotonic() - started
    with httpx.Client(base_url=url, timeout=30) as api:
        obs = observe(api, client_run_id, scenario.knobs.steps)
        label = ground_truth(scenario, obs)
        outcome = Outcome(
            scenario, label, obs, scenario.check_signals(obs, label), train_seconds=seconds
        )
        outcome.alerts = read_alerts(api, obs.run_id)
        outcome.advisor = _get_json(api, f"/api/v1/runs/{obs.run_id}/restart-candidates")
    outcome.problems = judge(outcome)
    return outcome


def judge(o: Outcome) -> list[str]:
    """Every expectation of the label the alerts and the advisor missed."""
    assert o.alerts is not None, "judge an outcome after its alerts are read"
    label = o.label
    problems = []
    fired = o.fired_rules
    if missing := label.must_fire - fired:
        problems.append(f"expected alerts did not fire: {sorted(missing)}")
    if forbidden := label.must_not_fire & fired:
        details = [_describe(a) for a in o.fired if a["rule"] in forbidden]
        problems.append(f"forbidden alerts fired: {details}")
    allowed = label.must_fire | label.may_fire
    reported = label.must_not_fire & fired  # already reported above
    problems.extend(
        f"unexpected {a['severity']} alert: {_describe(a)}"
        for a in o.fired
        if a["severity"] in label.must_not_fire_severity and a["rule"] not in allowed | reported
    )
    if label.collapse_before_floor:
        step = o.collapse_alert_step()
        if label.collapse_step is None:
            problems.append("no ground-truth collapse step (the scale never fell below 1.0)")
        elif step is None or step >= label.collapse_step:
            problems.append(
                f"loss_scale_collapse fired at step {step}, not before the scale fell below "
                f"1.0 at step {label.collapse_step}"
            )
    if label.forecast_before_freeze:
        step = o.first_step({"underflow_risk"})
        if step is None or label.first_frozen_step is None or step >= label.first_frozen_step:
            problems.append(f"underflow_risk fired at step {step}, not before the first layer "
                            f"froze at step {label.first_frozen_step}")  # fmt: skip
    if label.check_advisor:
        if o.advisor is None:
            problems.append("no restart-candidates endpoint")
        elif o.advisor_pick() != label.healthy_checkpoint:
            problems.append(
                f"advisor recommended checkpoint {o.advisor_pick()}, labeled "
                f"{label.healthy_checkpoint} (advisor onset {o.advisor.get('onset_step')} by "
                f"{o.advisor.get('onset_rule')}, margin {o.advisor.get('margin_steps')}; "
                f"ground-truth precursor began at {label.precursor_step})"
            )
    return problems


def _describe(alert: dict[str, Any]) -> str:
    layer = f"[{alert['layer']}]" if alert.get("layer") else ""
    return (f"{alert['rule']}{layer} {alert['severity']} {alert['status']} "
            f"started {alert.get('started_step')} fired {alert.get('fired_step')}: "
            f"{alert.get('message')} values={alert.get('values')}")  # fmt: skip
