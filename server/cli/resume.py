"""`ampwatch resume-plan RUN [--json] [--skip-batches FILE]`: the resume plan of a run
(`GET /api/v1/runs/{id}/resume-plan`), for a person or, with `--json`, for the relaunch
script that passes it to `watch(resume_from=...)`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ampwatch.server.cli.remote import get_of_run


def add_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    add_api: Callable[[argparse.ArgumentParser], None],
) -> None:
    plan = sub.add_parser(
        "resume-plan",
        help="where to restart a run from, the data to skip and what to change, with reasons",
    )
    plan.add_argument("run", help="run id, client run id, or run name")
    plan.add_argument(
        "--json", action="store_true", help="print the plan as JSON (watch(resume_from=FILE))"
    )
    plan.add_argument(
        "--skip-batches",
        metavar="FILE",
        help="also write the batch indices to skip as a JSON list (Lightning Fabric's "
        "skip_batches.json shape)",
    )
    add_api(plan)
    plan.set_defaults(func=cmd_resume_plan)


def format_resume_plan(plan: dict[str, Any]) -> str:
    """The plan in words: the checkpoint, the data to skip and each change, with reasons."""
    lines = [f"run {plan['run_id']} ({plan['client_run_id']}): {plan['why']}"]
    if plan["onset_step"] is not None:
        lines.append(f"incident onset at step {plan['onset_step']} ({plan['onset_rule']})")
    checkpoint = plan["checkpoint"]
    if checkpoint is not None:
        lines.append(f"checkpoint: step {checkpoint['step']}  {checkpoint['path'] or '(no path)'}")
        lines.extend(f"  - {reason}" for reason in checkpoint["reasons"])
    skip = plan["skip"]
    if skip is not None:
        lines.append(f"skip data: steps {skip['start']}-{skip['end']}")
        lines.extend(
            f"  - epoch {r['epoch']}: batches {r['start']}-{r['end']}" for r in skip["batches"]
        )
        lines.append(f"  - {skip['reason']}")
    for advice in plan["advice"]:
        lines.append(f"set {advice['setting']} = {advice['value']}")
        lines.append(f"  - {advice['reason']}")
    return "\n".join(lines)


def cmd_resume_plan(args: argparse.Namespace) -> int:
    plan = get_of_run(args, "resume-plan", "resume-plan")
    if plan is None:
        return 1
    if args.skip_batches:
        skip = plan["skip"]
        batches = skip["skip_batches"] if skip is not None else []
        Path(args.skip_batches).write_text(json.dumps(batches or [], indent=4))
    print(json.dumps(plan, indent=2) if args.json else format_resume_plan(plan))
    return 0
