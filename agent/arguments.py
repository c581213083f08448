"""`watch()`'s arguments, checked at attach time: a TypeError or ValueError that says how
to fix the call, before anything is hooked (the objects themselves: `ampwatch.agent.unwrap`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ampwatch.agent import config, fp8, wire
from ampwatch.agent.delivery import DeliveryOptions
from ampwatch.agent.scaler import checked_min_loss_scale


@dataclass(frozen=True, slots=True)
class Measures:
    """What `watch()` was asked to measure, and how it numbers and reports steps."""

    grad_norm: bool
    steps_from_every_rank: bool
    activation_max_abs: bool
    fp8_stats_every: int | None
    fp8_activations: bool
    fp8_recipe: str | None
    loss_reduction: str
    start_step: int
    min_loss_scale: float | None

    def checked(self) -> Measures:
        """ValueError/TypeError saying how to fix a bad one; `min_loss_scale` as a float."""
        fp8.check_options(self.fp8_stats_every, self.fp8_recipe)
        min_loss_scale = checked_min_loss_scale(self.min_loss_scale)
        if self.loss_reduction not in ("mean", "sum"):
            raise ValueError(f'loss_reduction must be "mean" or "sum", got {self.loss_reduction!r}')
        start = self.start_step
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"start_step must be an int >= 0, got {start!r}")
        return replace(self, min_loss_scale=min_loss_scale)


def check_arguments(
    model: object,
    optimizers: list[torch.optim.Optimizer],
    scaler: object,
    settings: config.Config,
    flush_interval: float,
    max_queue: int,
    transport: object,
) -> None:
    """The objects' types, the run's and project's names, and the sender's options."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}"
        )
    if scaler is not None and not optimizers:
        raise ValueError(
            "a scaler needs the optimizer(s) it steps: watch(model, optimizer, scaler)"
        )
    for label, value in (("run", settings.run), ("project", settings.project)):
        if value is not None and not (
            isinstance(value, str) and 0 < len(value) <= wire.MAX_NAME_LENGTH
        ):
            raise ValueError(
                f"{label} must be a non-empty string of at most {wire.MAX_NAME_LENGTH} characters"
            )
    every = settings.layer_stats_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"layer_stats_every must be an int >= 1, got {every!r}")
    if not flush_interval > 0:
        raise ValueError(f"flush_interval must be > 0 seconds, got {flush_interval!r}")
    if not isinstance(max_queue, int) or max_queue < 1:
        raise ValueError(f"max_queue must be an int >= 1, got {max_queue!r}")
    if transport is not None and not callable(transport):
        raise TypeError("transport must be a callable (body: bytes, headers: dict) -> HTTP status")


def check_delivery(delivery: object) -> None:
    """`delivery`: None (the defaults) or a `DeliveryOptions`."""
    if delivery is not None and not isinstance(delivery, DeliveryOptions):
        raise TypeError(
            f"delivery must be an ampwatch.agent.delivery.DeliveryOptions, got "
            f"{type(delivery).__name__}"
        )
