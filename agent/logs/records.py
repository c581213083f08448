"""A parsed log step as the agent's own sample, so `import` and `follow` send exactly the
records `handle.record()` would (one conversion: `ampwatch.agent.records.step_record`)."""

from __future__ import annotations

import hashlib
import socket
import time
from dataclasses import dataclass
from typing import Any

from ampwatch.agent import wire
from ampwatch.agent.logs.series import LogStep
from ampwatch.agent.records import StepSample, step_record


@dataclass(frozen=True, slots=True)
class Target:
    """Where a log's run goes and as what: the collector, its token, and the run's name,
    client id (None: derived from the log) and project (None: the token's)."""

    url: str
    token: str | None = None
    name: str | None = None
    run_id: str | None = None
    project: str | None = None


def step_sample(step: LogStep) -> StepSample:
    """The sample `handle.record(step=..., loss=..., loss_scale=..., skipped=...,
    grad_norm=..., lr=...)` makes; the final-layer norm a log prints is the mean."""
    host: dict[str, float | None] = {
        "loss": step.loss,
        "loss_scale": step.loss_scale,
        "found_inf": 1.0 if step.skipped else 0.0,
        "grad_norm": step.grad_norm,
        "lr": step.lr,
        "act_norm_mean": step.act_norm,
    }
    return StepSample(
        step.step, 0, (), None, None, {k: v for k, v in host.items() if v is not None}
    )


def wire_step(step: LogStep) -> wire.StepRecord:
    return step_record(step_sample(step))


def event(kind: str, step: int | None, data: dict[str, Any]) -> wire.EventRecord:
    return {"kind": kind, "step": step, "time": time.time(), "data": data}


def run_start(log_format: str, path: str, process: int, reason: str) -> wire.EventRecord:
    """A new process of the run, as the log shows it (`process` 0 is the first)."""
    return event("run_start", None, {
        "mode": "log", "log_format": log_format, "log_file": path, "process": process,
        "started_because": reason, "host": socket.gethostname(), "rank": 0, "world_size": 1,
    })  # fmt: skip


def derived_id(*parts: str) -> str:
    """A stable hex id from `parts`: the same log gives the same run and streams, so the
    collector's (run, stream, seq) dedup makes a second import store nothing."""
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:32]
