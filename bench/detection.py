"""Detection quality of the alert engine and the restart advisor on the scenario catalog.

    python bench/detection.py                       # every scenario
    python bench/detection.py --only nan_loss ...   # some of them

Each scenario of `tests/scenarios/scenario_catalog.py` trains for real (CPU autocast,
FP16/BF16, a real GradScaler where it has one) with the agent streaming into a collector
this script starts on a temporary SQLite file. Printed per scenario: the rules that fired
against those expected, false alerts by severity (fired, neither required nor allowed by
the label), the lead time (steps from the incident's first fired alert to the loss scale
falling below 1.0, or to the first frozen layer; negative = after it), and the advisor's
recommended checkpoint against the labeled one. The last line holds the bars:

- every expected alert fires;
- no critical alert on a healthy scenario (one whose label requires no alert:
  healthy_fp16, healthy_bf16, big_embedding, transient_overflow);
- the collapse alert fires before the scale falls below 1.0 when a precursor exists;
- the advisor picks the labeled checkpoint;
and two of ours: no false critical alert in any scenario (a critical alert whose rule the
label neither requires nor allows), and every scenario produced its labeled signals.

Exit status 0 when every bar holds, 1 otherwise, 2 when the collector has no alert engine.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The catalog lives beside the tests that use it; imported by file name, as pytest does.
sys.path.insert(0, str(ROOT / "tests" / "scenarios"))

from scenario_catalog import SCENARIOS
from scenario_judge import Outcome, run_scenario

from ampwatch.server.serving import BackgroundCollector, bind_socket
from ampwatch.server.settings import Settings


def _rules(rules: set[str] | frozenset[str]) -> str:
    return ",".join(sorted(rules)) or "-"


def _fired(o: Outcome) -> str:
    """Each fired rule with its highest severity, first fired step and alert count."""
    rank = {"info": 0, "warning": 1, "critical": 2}
    shown = []
    for rule in sorted(o.fired_rules):
        alerts = [a for a in o.fired if a["rule"] == rule]
        severity = max((a["severity"] for a in alerts), key=lambda v: rank.get(v, -1))
        count = f" x{len(alerts)}" if len(alerts) > 1 else ""
        shown.append(f"{rule}({severity}@{o.first_step({rule})}{count})")
    return " ".join(shown) or "-"


def report(o: Outcome) -> list[str]:
    label = o.label
    truth = (f"collapse<1.0@{label.collapse_step} precursor@{label.precursor_step} "
             f"frozen@{label.first_frozen_step} ckpt@{label.healthy_checkpoint}")  # fmt: skip
    head = f"{o.scenario.name}  ({o.scenario.knobs.steps} steps, {o.train_seconds:.1f}s)"
    lines = [f"{head}  truth: {truth}"]
    if o.signal_problems:
        lines.append(f"  SIGNALS NOT AS LABELED: {'; '.join(o.signal_problems)}")
    if o.alerts is None:
        lines.append("  alerts: endpoint missing")
        return lines
    fired = o.fired_rules
    lines.append(f"  fired    {_fired(o)}")
    missing = label.must_fire - fired
    lines.append(f"  expected {_rules(label.must_fire)}   missing {_rules(missing)}")
    false = o.false_alerts()
    shown = "  ".join(f"{sev}: {','.join(sorted(set(names)))}" for sev, names in
                      sorted(false.items())) or "none"  # fmt: skip
    lines.append(f"  false alerts  {shown}")
    lead = o.lead_time()
    target = "scale<1.0" if label.collapse_step else "first frozen layer"
    lines.append(f"  lead time  {'-' if lead is None else f'{lead} steps before {target}'}"
                 + (f"   collapse alert @{o.collapse_alert_step()}"
                    if label.collapse_before_floor else ""))  # fmt: skip
    if label.check_advisor:
        onset = "" if o.advisor is None else (
            f" (onset {o.advisor.get('onset_step')} by {o.advisor.get('onset_rule')}, "
            f"margin {o.advisor.get('margin_steps')})")  # fmt: skip
        lines.append(f"  advisor  picked {o.advisor_pick()}  labeled "
                     f"{label.healthy_checkpoint}{onset}")  # fmt: skip
    for problem in o.problems:
        lines.append(f"  MISS  {problem}")
    return lines


def bars(outcomes: list[Outcome]) -> tuple[bool, str]:
    judged = [o for o in outcomes if o.alerts is not None]
    expected = all(not (o.label.must_fire - o.fired_rules) for o in judged)
    no_critical = all(
        not any(a["severity"] == "critical" for a in o.fired)
        for o in judged if not o.label.must_fire  # healthy: nothing is required to fire
    )  # fmt: skip
    early = all(
        o.collapse_alert_step() is not None and o.label.collapse_step is not None
        and o.collapse_alert_step() < o.label.collapse_step
        for o in judged if o.label.collapse_before_floor
    )  # fmt: skip
    advisor = all(
        o.advisor_pick() is not None and o.advisor_pick() == o.label.healthy_checkpoint
        for o in judged if o.label.check_advisor
    )  # fmt: skip
    no_false_critical = all("critical" not in o.false_alerts() for o in judged)
    signals = all(not o.signal_problems for o in outcomes)
    marks = {"every expected alert fires": expected,
             "no critical alert on a healthy scenario": no_critical,
             "no false critical alert in any scenario": no_false_critical,
             "collapse alert before scale < 1.0": early,
             "advisor picks the labeled checkpoint": advisor,
             "scenarios produce their labeled signals": signals}  # fmt: skip
    ok = all(marks.values()) and len(judged) == len(outcomes)
    text = "bars: " + "; ".join(f"{k} {'OK' if v else 'MISSED'}" for k, v in marks.items())
    return ok, text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", metavar="SCENARIO",
                        choices=[s.name for s in SCENARIOS], help="run only these scenarios")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    chosen = [s for s in SCENARIOS if not args.only or s.name in args.only]
    started = time.monotonic()
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="ampwatch-detection-") as tmp:
        os.environ["AMPWATCH_SPOOL_DIR"] = str(Path(tmp) / "spool")  # never ~/.cache
        sock = bind_socket()
        settings = Settings(database_url=f"sqlite:///{Path(tmp) / 'detection.db'}",
                            port=sock.getsockname()[1], dashboard=False)
        with BackgroundCollector(settings, sock=sock):
            for scenario in chosen:
                outcome = run_scenario(scenario, settings.public_url, Path(tmp) / scenario.name)
                outcomes.append(outcome)
                print("\n".join(report(outcome)), flush=True)
    ok, text = bars(outcomes)
    print(f"{len(outcomes)} scenarios in {time.monotonic() - started:.0f}s")
    if any(o.alerts is None for o in outcomes):
        print("bars: not measured: the collector has no GET /api/v1/runs/{id}/alerts")
        return 2
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
