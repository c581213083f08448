"""The GradScaler tap: the unscaled loss from `scale()`, and the scale and skip at `update()`.

`torch.amp.GradScaler` keeps its scale and found-inf flags as device tensors; the flags exist
only between `step()` and `update()`. The tap reads them just before the real `update()`,
without a host sync (never `get_scale()`, which calls `.item()`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ampwatch.agent import wire
from ampwatch.agent.patch import patch_method
from ampwatch.agent.stats import RunningMean, power_of_two_exponent


def scaler_config(scaler: torch.amp.GradScaler) -> dict[str, Any]:
    """The scaler's settings, read from attributes only (`state_dict()` would sync)."""
    init_scale = getattr(scaler, "_init_scale", None)
    return {
        "enabled": scaler.is_enabled(),
        "class": f"{type(scaler).__module__}.{type(scaler).__qualname__}",
        "device": getattr(scaler, "_device", None),
        "init_scale": wire.encode_float(init_scale) if init_scale is not None else None,
        "growth_factor": getattr(scaler, "_growth_factor", None),
        "backoff_factor": getattr(scaler, "_backoff_factor", None),
        "growth_interval": getattr(scaler, "_growth_interval", None),
    }


def checked_min_loss_scale(value: float | None) -> float | None:
    """`watch(min_loss_scale=...)`, checked at attach: a scaler's configured floor is a
    positive finite number (fairseq's default 1e-4, DeepSpeed's and Megatron's 1); None
    where the scaler has none (torch's GradScaler) or it is not known.

    >>> checked_min_loss_scale(1e-4), checked_min_loss_scale(None)
    (0.0001, None)
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            "watch(min_loss_scale=...) takes the scaler's configured floor as a number, got "
            f"{type(value).__name__}"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"watch(min_loss_scale={value!r}): a scaler's floor is a positive finite number; "
            "pass None for a scaler without one (torch's GradScaler)"
        )
    return float(value)


def found_inf_total(scaler: torch.amp.GradScaler, device: torch.device) -> torch.Tensor | None:
    """Sum of this iteration's found-inf flags over every optimizer and device (no sync).

    These are exactly the flags `update()` consumes to back the scale off, so `> 0` is the
    skip, for fused optimizers too (they always run `step()` and skip inside the kernel).
    It stays exact where "the scale fell" would not: a scale already underflowed to 0, and
    `update(new_scale)`. FSDP1's `ShardedGradScaler` all-reduces its flags in `unscale_`
    (its own collective), so they hold every rank's overflow, as DDP's gradients do. None if no `step()` recorded flags (`update()` will then raise).
    """
    flags = [
        flag.to(device, non_blocking=True).reshape(())  # ShardedGradScaler's have shape (1,)
        for state in scaler._per_optimizer_states.values()
        for flag in state["found_inf_per_device"].values()
    ]
    if not flags:
        return None
    return flags[0] if len(flags) == 1 else torch.stack(flags).sum()


def keeps_power_of_two(scaler: torch.amp.GradScaler) -> bool:
    """Whether the scale stays a power of two: its start (`_init_scale`, which
    `load_state_dict` also sets) and both factors are, read from attributes (no sync).
    Decides on the training thread whether the range statistics need direct counts; the
    sender thread checks the copied scale itself before using the histogram shift."""
    values = (
        getattr(scaler, "_init_scale", None),
        getattr(scaler, "_growth_factor", None),
        getattr(scaler, "_backoff_factor", None),
    )
    return all(
        isinstance(v, (int, float)) and power_of_two_exponent(float(v)) is not None for v in values
    )


class ScalerTap:
    """Patches `scale` and `update` on ONE scaler instance and restores them exactly.

    The callbacks run around the real `update()`: `before_update()` (device work, may return
    None to skip) and `after_update(prepared)` only if the real update returned normally, so
    misuse errors (update without step) reach the user unchanged and record nothing.
    `boundary()`, last, outside the agent's own error handling: the step boundary where a
    `watch(on_critical="raise")` policy may raise (`ampwatch.agent.policy`).
    """

    def __init__(
        self,
        scaler: torch.amp.GradScaler,
        *,
        before_update: Callable[[], Any],
        after_update: Callable[[Any], None],
        on_error: Callable[[BaseException], None],
        boundary: Callable[[], None] = lambda: None,
    ) -> None:
        self._scaler = scaler
        self._boundary = boundary
        self._before_update = before_update
        self._after_update = after_update
        self._on_error = on_error
        self.loss = RunningMean()
        #: Set once `update(new_scale)` sets a scale that may not be a power of two.
        self.scale_left_powers_of_two = False
        self._originals: dict[str, Any] = {}
        self._restores: list[Callable[[], None]] = []

    def attach(self) -> None:
        for name, wrapper in (("scale", self._scale), ("update", self._update)):
            self._restores.append(patch_method(self._scaler, name, self._keep(name, wrapper)))

    def _keep(self, name: str, wrapper: Callable[..., Any]) -> Callable[[Any], Any]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            self._originals[name] = original
            return wrapper

        return make

    def detach(self) -> None:
        for restore in reversed(self._restores):
            restore()
        self._restores.clear()

    def _scale(self, outputs: Any) -> Any:
        if isinstance(outputs, torch.Tensor):
            try:
                loss = outputs.detach()
                self.loss.add(loss.float().mean() if loss.dim() else loss)
            except Exception as exc:  # noqa: BLE001 - the agent never raises into the training loop
                self._on_error(exc)
        return self._originals["scale"](outputs)

    def _update(self, new_scale: float | torch.Tensor | None = None) -> None:
        try:
            prepared = self._before_update()
        except Exception as exc:  # noqa: BLE001 - the agent never raises into the training loop
            self._on_error(exc)
            prepared = None
        self._originals["update"](new_scale)
        if new_scale is not None and (
            isinstance(new_scale, torch.Tensor) or power_of_two_exponent(float(new_scale)) is None
        ):
            self.scale_left_powers_of_two = True
        if prepared is not None:
            try:
                self._after_update(prepared)
            except Exception as exc:  # noqa: BLE001 - the agent never raises into the training loop
                self._on_error(exc)
        self._boundary()
