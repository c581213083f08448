"""What a batch's events do to the rules, before its steps are judged: an agent finding
raises its rule; a `run_start` of the followed rank (a new training process) restarts the
process's state and resolves the old process's findings; a `resumed` event (a resume plan
applied) resolves every open alert."""

from __future__ import annotations

from typing import Any

from ampwatch.agent.wire import SCALER_CALIBRATED
from ampwatch.server.alerts import rules
from ampwatch.server.alerts.fp8 import RULE as FP8_RULE
from ampwatch.server.alerts.lifecycle import Tracker
from ampwatch.server.alerts.rule_settings import RuleSettings
from ampwatch.server.alerts.scale import reported_floor
from ampwatch.server.alerts.state import StepState
from ampwatch.server.fp8_readiness import recipe_of
from ampwatch.server.schemas.wire import BatchIn


def apply_events(
    tracker: Tracker, state: StepState, batch: BatchIn, settings: dict[str, RuleSettings]
) -> int | None:
    """Findings raise their rules; a `run_start` of the followed rank (a new process: the
    run started or resumed, maybe from an earlier checkpoint) restarts calibration and the
    step sequence and resolves the old process's findings; a `resumed` one (`watch(resume_from=
    plan)`) resolves every open alert. Returns that rank, if any."""
    restarted = None
    for event in batch.events:
        step = event.step if event.step is not None else (state.last_step or 0)
        if event.kind == "run_start":
            rank = event.data.get("rank", 0)
            rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else 0
            if state.rank is not None and rank != state.rank:
                continue  # another rank's process: the followed one still runs
            state.reset_process()
            state.min_loss_scale = reported_floor(event.data)
            state.calibrated_at_start = event.data.get(SCALER_CALIBRATED) is True
            state.last_step = None
            restarted = rank
            for rule in rules.FINDING_RULES.values():  # a new process reports its own findings
                tracker.resolve(rule, step)
            recipe = recipe_of(event.data)
            if recipe != state.fp8_recipe:  # judged against another recipe, or none, now
                state.fp8_recipe = recipe
                for layer in tracker.open_layers(FP8_RULE):
                    tracker.resolve(FP8_RULE, step, layer=layer)
        elif event.kind == "finding":
            code = str(event.data.get("code"))
            if code == "fp16_params_without_scaler":
                state.fp16_without_scaler = True
            finding_rule = rules.FINDING_RULES.get(code)
            if finding_rule is None or not settings[finding_rule].enabled:
                continue  # bf16_in_use, fp8_in_use: facts, shown as events
            message = str(event.data.get("message") or finding_rule)

            def detail(message: str = message, data: dict[str, Any] = event.data,
                       step: int = step) -> tuple[str, dict[str, Any]]:  # fmt: skip
                return f"{message} (reported at step {step})", {"finding": data, "step": step}

            tracker.holds(finding_rule, step, detail)
        elif event.kind == "resumed":  # from a resume plan: the abandoned steps' alerts end
            for rule, layer in list(tracker.open):
                tracker.resolve(rule, step, layer=layer)
    return restarted
