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


#: The scaler's initial scale by default, per format (a fresh scaler's first attempt):
#: torch's GradScaler, apex and DeepSpeed 2^16, Megatron-LM 2^32, fairseq 128, metaseq 4.
INITIAL_SCALE = {"megatron": 2.0**32, "fairseq": 128.0, "metaseq": 4.0}
DEFAULT_INITIAL_SCALE = 2.0**16
#: A log whose first printed step is at most this starts with its process.
FIRST_STEPS = 10


def scaler_history(log_format: str, first: LogStep | None, *, numbered: bool) -> str | None:
    """Why the process's scaler already has a history at `first` (the process's first
    step as the log shows it), or None when its warm-up is the collector's to judge.

    A fresh scaler starts at its initial scale. A log that prints step numbers and starts
    past step FIRST_STEPS at another scale (or at no printed scale) starts mid-run, or is a
    resumed process whose scaler was restored; a log that prints none (apex, bare DeepSpeed
    OVERFLOW lines) starts mid-run when its first attempted scale is not the initial one.

    >>> scaler_history("apex", LogStep(1, loss_scale=1.6e-201, skipped=True), numbered=False)
    "the first attempted scale 1.6e-201 is not apex's initial 65536"
    """
    if first is None:
        return None
    initial = INITIAL_SCALE.get(log_format, DEFAULT_INITIAL_SCALE)
    at_initial = first.loss_scale is not None and first.loss_scale == initial
    if numbered:
        if first.step <= FIRST_STEPS or at_initial:
            return None
        shown = "no printed scale" if first.loss_scale is None else f"scale {first.loss_scale:g}"
        return f"the log starts at step {first.step}, {shown} (initial {initial:g})"
    if first.loss_scale is None or at_initial:
        return None
    return (f"the first attempted scale {first.loss_scale:g} is not {log_format}'s initial "
            f"{initial:g}")  # fmt: skip


def run_start(log_format: str, path: str, process: int, reason: str,
              history: str | None = None) -> wire.EventRecord:  # fmt: skip
    """A new process of the run, as the log shows it (`process` 0 is the first); `history`:
    why its scaler is not fresh (`scaler_history`), sent as `wire.SCALER_CALIBRATED`."""
    data: dict[str, Any] = {
        "mode": "log", "log_format": log_format, "log_file": path, "process": process,
        "started_because": reason, "host": socket.gethostname(), "rank": 0, "world_size": 1,
    }  # fmt: skip
    if history is not None:
        data[wire.SCALER_CALIBRATED] = True
        data["scaler_history"] = history
    return event("run_start", None, data)


def derived_id(*parts: str) -> str:
    """A stable hex id from `parts`: the same log gives the same run and streams, so the
    collector's (run, stream, seq) dedup makes a second import store nothing."""
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:32]
