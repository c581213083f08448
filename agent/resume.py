"""`watch(resume_from=plan)`: continue a run from its resume plan.

The plan is the collector's (`GET /api/v1/runs/{id}/resume-plan`, `ampwatch resume-plan
RUN --json > plan.json`): a dict, or the path of that JSON file. The relaunch script
loads the checkpoint it names, applies the advice it wants (`plan.advice["lr"]`), skips
the batches it lists (`plan.skips(batch_idx, epoch)`), and passes it to `watch()`, which
continues the same run id from the checkpoint's step and sends a `resumed` event: the
collector resolves the alerts that were firing (they belong to the abandoned steps) and
the dashboard can tell the branches apart.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ResumeFrom:
    """A resume plan, read: what `watch()` and the relaunch script need from it."""

    client_run_id: str
    name: str
    #: The checkpoint to load: its step (the resumed run's `start_step`) and path.
    step: int
    path: str | None
    #: Setting -> value (`lr`, `init_scale`, `growth_interval`, `precision`); reasons in `plan`.
    advice: dict[str, Any]
    #: The steps of data to skip (inclusive), or None.
    skip_steps: tuple[int, int] | None
    #: (epoch, first, last) batch ranges to skip, inclusive.
    skip_batches: tuple[tuple[int, int, int], ...]
    #: Alerts firing when the plan was made: the resumed process does not act on them.
    alert_ids: frozenset[int] = field(default_factory=frozenset)
    #: The plan as the collector sent it.
    plan: dict[str, Any] = field(default_factory=dict)

    def skips(self, batch: int, epoch: int = 0) -> bool:
        """Should the relaunched loop skip batch `batch` of `epoch`?"""
        return any(e == epoch and first <= batch <= last for e, first, last in self.skip_batches)

    def summary(self) -> dict[str, Any]:
        """What the `resumed` event records."""
        return {
            "from_step": self.step,
            "checkpoint": self.path,
            "onset_step": self.plan.get("onset_step"),
            "onset_rule": self.plan.get("onset_rule"),
            "skip_steps": list(self.skip_steps) if self.skip_steps else None,
            "skip_batches": [list(r) for r in self.skip_batches],
            "advice": self.advice,
            "abandoned_alerts": sorted(self.alert_ids),
        }


def load_resume_plan(plan: Mapping[str, Any] | str | os.PathLike[str] | ResumeFrom) -> ResumeFrom:
    """Read a resume plan (a dict, the path of its JSON file, or one already read).
    Raises ValueError when it is not a plan or names no checkpoint to resume from."""
    if isinstance(plan, ResumeFrom):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        plan = json.loads(Path(plan).read_text())
    if not isinstance(plan, Mapping) or "client_run_id" not in plan:
        raise ValueError("resume_from must be a resume plan: `ampwatch resume-plan RUN --json`")
    checkpoint = plan.get("checkpoint")
    if not plan.get("ready") or not isinstance(checkpoint, Mapping):
        raise ValueError(f"the resume plan names no checkpoint: {plan.get('why')}")
    step = checkpoint.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError("the resume plan's checkpoint has no step")
    skip = plan.get("skip") or {}
    return ResumeFrom(
        client_run_id=str(plan["client_run_id"]),
        name=str(plan.get("name") or plan["client_run_id"]),
        step=step,
        path=checkpoint.get("path"),
        advice={a["setting"]: a["value"] for a in plan.get("advice") or []},
        skip_steps=(int(skip["start"]), int(skip["end"])) if skip else None,
        skip_batches=tuple(
            (int(r["epoch"]), int(r["start"]), int(r["end"])) for r in skip.get("batches") or []
        ),
        alert_ids=frozenset(int(i) for i in plan.get("firing_alert_ids") or []),
        plan=dict(plan),
    )
