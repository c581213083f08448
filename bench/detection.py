"""Detection quality of the alert engine and the restart advisor on the scenario catalog.

    python bench/detection.py                       # every scenario
    python bench/detection.py --only nan_loss ...   # some of them (no real-log corpus)
    python bench/detection.py --real-logs           # the real-log corpus alone

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

Then the real-log corpus (`tests/data/real_logs/`, `tests/scenarios/real_logs.py`): each
public excerpt replayed through `handle.record()` into the same collector. Printed per
excerpt: its label, ampwatch's alerts (rule, severity, fired step), for an incident whether
it alerted by the labeled deadline and the lead time, and side by side the first step each
peer's published rule flags on the same series (Megatron's 10x the first 100 losses,
OLMo-core's 6 sigma over 128, Lightning Fabric's SpikeDetection defaults, a fixed min_scale
of 1 and of 1e-4). Then false alerts on the healthy excerpts, per 10,000 steps they cover,
ampwatch's and each peer's, and the advisor's pick on excerpts with checkpoints. The bars:

- every labeled incident alerted by its deadline;
- no critical alert on a healthy or self-recovering run; at most 1 warning per 10,000
  healthy steps;
- ampwatch alerts on every incident any peer flags, no later (exceptions printed), with
  fewer false alerts than each peer;
- the advisor's pick precedes the incident and any non-finite loss.

    python bench/detection.py --real-logs        # the corpus only (seconds)

Early warning (issue 32), `--precursors`: tiny CPU trainings designed to diverge the way
large runs do, and healthy ones (`tests/scenarios/precursor_runs.py`), each into the same
collector; per run, the event step (defined from the training alone), ampwatch's first
warning and first critical, and the first flag of Megatron's 10x rule, OLMo-core's 6 sigma
over 128, Lightning Fabric's SpikeDetection and llm-foundry's KillLossSpike on its losses.
Tuning seeds and held-out seeds are summed up apart.

    python bench/detection.py --precursors --seeds 4   # 4 tuning + 4 held-out seeds

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

import precursor_runs
import public_logs
import real_logs
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
    lines.extend(f"  MISS  {problem}" for problem in o.problems)
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


def _alerts(v: real_logs.Verdict) -> str:
    return " ".join(f"{a['rule']}({a['severity']}@{a['fired_step']})"
                    for a in sorted(v.alerts, key=lambda a: a["fired_step"] or 0)) or "-"  # fmt: skip


def report_real(v: real_logs.Verdict) -> list[str]:
    label = v.label
    head = f"{v.excerpt.name}  [{label.kind}, {len(v.excerpt.steps)} records, {v.span} steps]"
    lines = [head, f"  alerts   {_alerts(v)}"]
    if label.kind == "incident":
        lead = v.lead
        verdict = "ALERTED" if v.caught() else "MISSED"
        lines.append(
            f"  {verdict} by deadline {label.deadline_step}: first alert "
            f"{v.first_alert}, lead time {lead if lead is not None else '-'} steps"
        )
        peers = "  ".join(f"{name}={v.peer_caught(name) if v.peer_caught(name) is not None else '-'}"
                          for name in real_logs.PEERS)  # fmt: skip
        lines.append(f"  peers (first flag by the deadline)  {peers}")
    else:
        flagged = "  ".join(f"{name}={real_logs.episodes(flags)}"
                            for name, flags in v.peers.items() if flags)  # fmt: skip
        lines.append(f"  peers' flags  {flagged or 'none'}")
    if v.excerpt.checkpoints and v.advisor is not None:
        picked = (v.advisor.get("recommended") or {}).get("step")
        lines.append(
            f"  advisor  picked {picked} of {[c for c, _ in v.excerpt.checkpoints]}; "
            f"onset {v.advisor.get('onset_step')} ({v.advisor.get('onset_rule')})"
        )
    lines.extend(f"  NOTE  {problem}" for problem in v.problems())
    return lines


def bars_real(verdicts: list[real_logs.Verdict]) -> tuple[bool, list[str]]:
    incidents = [v for v in verdicts if v.label.kind == "incident"]
    calm = [v for v in verdicts if v.label.kind in ("healthy", "transient")]
    rates = real_logs.false_alert_rates(verdicts)
    ours = rates["ampwatch critical"]["count"] + rates["ampwatch warning"]["count"]
    later = [(v.excerpt.name, peer, v.first_alert, v.peer_caught(peer))
             for v in incidents for peer in real_logs.PEERS
             if v.peer_caught(peer) is not None
             and (v.first_alert is None or v.first_alert > v.peer_caught(peer))]  # fmt: skip
    lines = [
        (
            f"real logs: {len(incidents)} incidents, {sum(v.caught() for v in incidents)} alerted by "
            f"their deadline; lead times {[v.lead for v in incidents]}"
        ),
        "false alerts on healthy excerpts ({:.0f} steps): ".format(
            rates["ampwatch critical"]["healthy_steps"]
        )
        + "; ".join(f"{k} {r['count']} ({r['per_10k']:.0f}/10k)" for k, r in rates.items()),
    ]
    healthy = [v for v in verdicts if v.label.kind == "healthy"]
    with_loss = sum(s.loss is not None for v in healthy for s in v.excerpt.steps)
    lines.append(
        f"  healthy records with a loss value: {with_loss} (the loss-spike peers and "
        "loss_spike judge only these; the long DeepSpeed-Chat logs print no loss)"
    )
    for name, peer, ours_at, theirs in later:
        lines.append(f"  later than a peer: {name}: {peer} at {theirs}, ampwatch at {ours_at}")
    peer_false = {k: r["count"] for k, r in rates.items() if not k.startswith("ampwatch")}
    marks = {
        "every incident alerted by its deadline": all(v.caught() for v in incidents),
        "no critical on healthy/transient runs": all(not v.by_severity("critical") for v in calm),
        "<= 1 warning per 10k healthy steps": rates["ampwatch warning"]["per_10k"] <= 1.0,
        "no incident flagged by a peer before ampwatch": not later,
        "fewer false alerts than each peer": all(ours < n for n in peer_false.values() if n)
        and ours == 0,
        "advisor picks before the incident": all(not v.advisor_problems() for v in verdicts),
    }
    known = [(n, p) for n, p, a, t in later
             if a is not None and a - t <= real_logs.KNOWN_LATER.get((n, p), -1)]  # fmt: skip
    notes = {
        "no incident flagged by a peer before ampwatch": (
            f" ({len(known)} of {len(later)} a measured trade-off, real_logs.KNOWN_LATER: "
            + ", ".join(f"{n} vs {p}" for n, p in known)
            + ")"
        )
        if known
        else ""
    }
    lines.append("real-log bars: " + "; ".join(f"{k} {'OK' if ok else 'MISSED'}{notes.get(k, '')}"
                                                for k, ok in marks.items()))  # fmt: skip
    return all(marks.values()), lines


def report_public(verdicts: list[public_logs.Verdict], printed: list[public_logs.Replayed]) -> bool:
    """The public-log corpus through `ampwatch import`: the per-file table, every bar
    missed in words, and the bars on the tuning part and on the held-back part apart. Then
    the alert engine alone: each labeled log's printed values (the corpus' own reading)
    through the manual API, whether or not `import` reads its format yet."""
    print("\npublic logs through `ampwatch import` (tests/data/public_logs; printed values read by "
          "the corpus' own regexes; n/st: printed but not stored; manual: the manual API's first "
          "alert)")  # fmt: skip
    print("\n".join(public_logs.table(verdicts)))
    for v in verdicts:
        for problem in v.problems():
            print(f"  {v.log.name}: {problem}")
    ok = True
    for part, chosen in (("tuning", [v for v in verdicts if not v.log.held_back]),
                         ("held back", [v for v in verdicts if v.log.held_back])):  # fmt: skip
        warnings, steps, rate = public_logs.warnings_per_10k(chosen)
        marks = public_logs.bars(chosen)
        incidents = [v for v in chosen if v.log.kind == "incident"]
        print(f"public logs, {part}: {len(chosen)} logs, {sum(v.imported.read for v in chosen)} read; "
              f"{sum(v.values.printed for v in chosen)} values printed, "
              f"{sum(v.values.equal for v in chosen)} stored equal, "
              f"{sum(len(v.values.contradicted) for v in chosen)} contradicted; "
              f"healthy steps {steps}, warnings {warnings} ({rate:.2f}/10k); incidents caught "
              f"{sum(v.caught(v.first_alert) for v in incidents)}/{len(incidents)}")  # fmt: skip
        print(
            f"public-log bars ({part}): "
            + "; ".join(f"{k} {'OK' if held else 'MISSED'}" for k, held in marks.items())
        )
        ok = ok and all(marks.values())
    print("\nthe printed values themselves through the manual API (labeled logs):")
    for part in (False, True):
        chosen = [r for r in printed if r.log.held_back == part and r.span]
        healthy = [r for r in chosen if r.log.kind == "healthy"]
        steps = sum(r.span for r in healthy)
        warnings = sum(len(r.by_severity("warning")) for r in healthy)
        critical = [
            r.log.name for r in chosen if r.log.kind != "incident" and r.by_severity("critical")
        ]
        incidents = [r for r in chosen if r.log.kind == "incident"]
        caught = [r for r in incidents if r.first_alert is not None
                  and r.log.deadline_step is not None and r.first_alert <= r.log.deadline_step]  # fmt: skip
        for r in chosen:
            if r.alerts:
                print(
                    f"  {r.log.name} [{r.log.kind}]: "
                    + " ".join(f"{a['rule']}({a['severity']}@{a['fired_step']})" for a in r.alerts)
                )
        print(f"  {'held back' if part else 'tuning'}: healthy steps {steps}, warnings {warnings} "
              f"({1e4 * warnings / steps if steps else 0:.2f}/10k), criticals on calm logs "
              f"{critical or 'none'}, incidents caught {len(caught)}/{len(incidents)} "
              f"(missed: {[r.log.name for r in incidents if r not in caught] or 'none'})")  # fmt: skip
    return ok


def precursors(seeds: int) -> int:
    """The early-warning bench (module docstring); 0 when every bar holds on both sets."""
    import torch

    torch.set_num_threads(1)
    logging.getLogger("ampwatch.agent").setLevel(logging.ERROR)  # criticals print per run
    chosen = list(range(seeds)) + [precursor_runs.HELD_OUT_FROM + s for s in range(seeds)]
    measured = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ampwatch-precursors-") as tmp:
        os.environ["AMPWATCH_SPOOL_DIR"] = str(Path(tmp) / "spool")
        sock = bind_socket()
        settings = Settings(database_url=f"sqlite:///{Path(tmp) / 'precursors.db'}",
                            port=sock.getsockname()[1], dashboard=False)  # fmt: skip
        with BackgroundCollector(settings, sock=sock):
            for config in precursor_runs.configs(chosen):
                measured.append(precursor_runs.measure(config, settings.public_url))
                print(precursor_runs.row(measured[-1]), flush=True)
    ok = True
    for label, held in (("tuning", False), ("held out", True)):
        runs = [m for m in measured if m.trained.config.held_out == held]
        lines, bars = precursor_runs.summary(runs, label)
        print("\n".join(lines))
        marks = " ".join(f"{k}={'ok' if v else 'MISSED'}" for k, v in bars.items())
        print(f"  bars: {marks}")
        ok = ok and all(bars.values())
    print(f"{len(measured)} runs in {time.monotonic() - started:.0f}s")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="SCENARIO",
        choices=[s.name for s in SCENARIOS],
        help="run only these scenarios, and not the real-log corpus",
    )
    parser.add_argument(
        "--real-logs",
        action="store_true",
        help="only the real-log corpus, not the training scenarios",
    )
    parser.add_argument(
        "--precursors", action="store_true", help="only the early-warning trainings"
    )
    parser.add_argument("--seeds", type=int, default=4, help="--precursors: seeds per set")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.precursors:
        return precursors(args.seeds)
    chosen = [s for s in SCENARIOS if not args.real_logs and (not args.only or s.name in args.only)]
    verdicts: list[real_logs.Verdict] = []
    started = time.monotonic()
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="ampwatch-detection-") as tmp:
        os.environ["AMPWATCH_SPOOL_DIR"] = str(Path(tmp) / "spool")  # never ~/.cache
        sock = bind_socket()
        settings = Settings(
            database_url=f"sqlite:///{Path(tmp) / 'detection.db'}",
            port=sock.getsockname()[1],
            dashboard=False,
        )
        with BackgroundCollector(settings, sock=sock):
            for scenario in chosen:
                outcome = run_scenario(scenario, settings.public_url, Path(tmp) / scenario.name)
                outcomes.append(outcome)
                print("\n".join(report(outcome)), flush=True)
            for excerpt, label in real_logs.corpus() if not args.only else ():
                verdict = real_logs.replay_and_judge(excerpt, label, settings.public_url)
                verdicts.append(verdict)
                print("\n".join(report_real(verdict)), flush=True)
            public = [] if args.only else [
                public_logs.judge(log, settings.public_url) for log in public_logs.manifest()
            ]  # fmt: skip
            printed = [] if args.only else [
                public_logs.replay_printed(log, settings.public_url)
                for log in public_logs.manifest() if log.kind != "unlabeled"
            ]  # fmt: skip
    real_ok, real_lines = bars_real(verdicts) if verdicts else (True, [])
    print("\n".join(real_lines))
    public_ok = report_public(public, printed) if public else True
    real_ok = real_ok and public_ok
    if args.real_logs:
        return 0 if real_ok else 1
    ok, text = bars(outcomes)
    ok = ok and real_ok
    print(f"{len(outcomes)} scenarios in {time.monotonic() - started:.0f}s")
    if any(o.alerts is None for o in outcomes):
        print("bars: not measured: the collector has no GET /api/v1/runs/{id}/alerts")
        return 2
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
