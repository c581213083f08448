"""The handle `watch()` returns, and what a disabled agent's handle does: nothing.

`detach()` is idempotent and removes everything the agent attached, as torch's
`RemovableHandle.remove()`; the handle is a context manager; `Lifecycle` guards reuse.
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from ampwatch.agent.batching import idle_counters
from ampwatch.agent.data_position import DataPositions
from ampwatch.agent.policy import AlertPolicy, FiringAlert
from ampwatch.agent.transport import Sender

if TYPE_CHECKING:
    from typing_extensions import Self

logger = logging.getLogger("ampwatch.agent")


class Lifecycle(enum.Enum):
    """Where a handle is: attached, detached (for good), or disabled from the start."""

    ATTACHED = "attached"
    DETACHED = "detached"
    DISABLED = "disabled"


class WatchHandle:
    """What `watch()` returns. Like torch's `RemovableHandle`: `detach()` is idempotent and
    removes everything the agent attached; the handle is also a context manager. A disabled
    handle accepts every call and records nothing."""

    def __init__(self, *, client_run_id: str, state: Lifecycle) -> None:
        self.client_run_id = client_run_id
        self._state = state
        self._step = 0
        self._errors = 0
        self._detach_actions: list[Callable[[], None]] = []
        self._sender: Sender | None = None
        #: Hears the collector's answers (`watch(on_critical=...)`); None when disabled.
        self._policy: AlertPolicy | None = None
        self._positions = DataPositions()

    @property
    def state(self) -> Lifecycle:
        return self._state

    @property
    def step(self) -> int:
        """Optimizer steps seen so far, skipped ones included (with a scaler: its updates)."""
        return self._step

    @property
    def alerts(self) -> tuple[FiringAlert, ...]:
        """The run's firing alerts, as the collector's latest answer listed them (critical
        first); () offline, disabled, or before the first answer."""
        return self._policy.firing if self._policy is not None else ()

    @property
    def should_stop(self) -> bool:
        """True once a critical alert fired with `on_critical="stop"` (or "raise"): save a
        checkpoint and stop the loop. A plain attribute read: check it every step."""
        return self._policy is not None and self._policy.should_stop

    @property
    def exit_code(self) -> int:
        """`ampwatch.agent.EXIT_CRITICAL_ALERT` once the policy stopped the run for a
        critical alert, else 0: end the script with `sys.exit(handle.exit_code)` so that a
        launcher can tell the stop from a crash and relaunch from the resume plan."""
        return self._policy.exit_code if self._policy is not None else 0

    def _at_boundary(self, *_: object) -> None:
        """A step boundary on the training thread: where "raise" and a callable act."""
        if self._policy is not None:
            self._policy.at_boundary(self)

    @property
    def counters(self) -> dict[str, int]:
        """Delivery and health counters: batches_sent, send_failures, dropped_steps, ..."""
        counters = self._sender.counters() if self._sender is not None else idle_counters()
        return {**counters, "hook_errors": self._errors}

    def log_loss(self, loss: torch.Tensor | float) -> None:
        """Report the loss of a micro-batch (a tensor: no host sync; or a number).

        The step's loss is the mean of the micro-batch losses logged since the previous
        step (their sum with `watch(..., loss_reduction="sum")`). Logged losses win over
        what `scaler.scale()` saw: an integration logs the undivided loss there.
        """

    def record(
        self,
        *,
        step: int | None = None,
        loss: float | torch.Tensor | None = None,
        loss_scale: float | torch.Tensor | None = None,
        skipped: bool | torch.Tensor | None = None,
        grad_norm: float | torch.Tensor | None = None,
        lr: float | torch.Tensor | None = None,
    ) -> None:
        """Record one optimizer step by hand (see `ampwatch.agent.manual`); never raises."""
        if self._state is Lifecycle.ATTACHED:
            values: dict[str, object] = {
                "loss": loss, "loss_scale": loss_scale, "found_inf": skipped,
                "grad_norm": grad_norm, "lr": lr,
            }  # fmt: skip
            self._record(step, values)
            self._at_boundary()

    def _record(self, step: int | None, values: dict[str, object]) -> None:
        """The attached handle's `record()`, with the step's values by wire name."""

    def data_position(self, batch: int, *, epoch: int = 0) -> None:
        """Report the index of the first batch (`batch_idx`) the current optimizer step
        consumes, in `epoch`: a resume plan then lists the batches to skip, not only the
        steps. Call it every step (micro-batches after the first are ignored); it sends an
        event only when the position stops following its stride. It is a step boundary:
        `on_critical="raise"` may raise `CriticalAlert` here; nothing else is raised."""
        if self._state is not Lifecycle.ATTACHED:
            return
        try:
            noted = self._positions.note(self._step + 1, epoch, batch)
            if noted is not None:
                self._event("data_position", *noted)
        except Exception as exc:  # noqa: BLE001 - reported, never raised into training
            self._on_error(exc)
        self._at_boundary()

    def checkpoint(self, path: str | os.PathLike[str], step: int | None = None) -> None:
        """Record that a checkpoint was saved at `step` (default: the current step)."""
        self._event("checkpoint", self._step if step is None else step, {"path": os.fspath(path)})

    def save_checkpoint(
        self, obj: object, path: str | os.PathLike[str], step: int | None = None
    ) -> None:
        """`torch.save(obj, path)`, then `checkpoint(path, step)`. A failed save raises as
        torch.save does and records nothing; a disabled agent still saves."""
        torch.save(obj, path)
        self.checkpoint(path, step)

    def detach(
        self, status: str = "finished", reason: str | None = None, *, timeout: float = 5.0
    ) -> None:
        """Remove every hook and patch, send `run_end`, flush for at most `timeout` seconds.

        Idempotent: later calls do nothing.
        """
        if self._state is not Lifecycle.ATTACHED:
            return
        for action in reversed(self._detach_actions):
            action()
        self._detach_actions.clear()
        self._event("run_end", self._step, {"status": status, "reason": reason})
        self._state = Lifecycle.DETACHED
        if self._sender is not None:
            self._sender.close(timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.detach("finished")
        else:
            self.detach("failed", reason=repr(exc))

    def _event(self, kind: str, step: int | None, data: dict[str, Any]) -> None:
        if self._state is Lifecycle.ATTACHED and self._sender is not None:
            self._sender.put({"kind": kind, "step": step, "time": time.time(), "data": data})

    def _on_error(self, exc: BaseException) -> None:
        """Hook bodies report here: log the first failure with its traceback, count all."""
        if self._errors == 0:
            logger.warning("ampwatch agent hook failed; training continues", exc_info=exc)
        self._errors += 1
