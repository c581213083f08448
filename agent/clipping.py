"""Detects `clip_grad_norm_` applied to gradients that are still scaled (before `unscale_`),
and hands each watched loop the norm its own clip returned.

Clipping scaled gradients clips against a threshold S times too small (or, as S changes,
by a moving amount): DESIGN's canonical order is backward(S·L) → unscale_ → clip → step.
A GradScaler marks each optimizer's stage in `_per_optimizer_states[id(opt)]["stage"]`:
READY until `unscale_` (or `step`) in the iteration, so a clip that touches a parameter of
a watched optimizer whose stage is READY, while its grads carry the scale, is the bug.

The total norm a clip returns is the norm BEFORE clipping, which the loop has already paid
for: observers (`observe`) get it, and the agent stores it as the step's grad norm instead
of a second pass over every gradient. Read after clipping instead, a spike is stored as the
threshold (HF's default `max_grad_norm=1.0` turns every spike into ~1.0). The clip's
`max_norm` goes to observers too: the norm after clipping follows from the two on the
device (`clipped_norm`), without a second pass or a host read.

`clip_grad_norm_` is a plain function looked up on its module at call time, so the only
way to see the call without the user's help is to replace that attribute. The replacement
is narrow: one wrapper shared by every live handle, installed when the first registers and
the original object put back, unchanged, when the last one leaves. A loop that imported
the function by name before `watch()` (`from torch.nn.utils import clip_grad_norm_`)
keeps the original and goes unchecked (Lightning, accelerate and the HF Trainer look it up
on `torch.nn.utils` at call time).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.utils.clip_grad as _clip_grad_module
from torch.amp.grad_scaler import OptState

Check = Callable[[list[torch.Tensor]], None]
#: (parameters clipped, the total norm the clip returned, its max_norm, its norm_type)
Observer = Callable[[list[torch.Tensor], torch.Tensor, Any, Any], None]

#: Checkers of live handles: each gets the parameters being clipped, before the clip.
_checkers: list[Check] = []
#: Observers of live handles: each gets what the clip returned, after it.
_observers: list[Observer] = []
_original: Callable[..., torch.Tensor] | None = None


def _wrapper(parameters: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    assert _original is not None
    if isinstance(parameters, torch.Tensor):
        params = [parameters]
    else:
        parameters = params = list(parameters)  # a generator must reach the original intact
    for check in _checkers:
        check(params)  # checkers never raise (see ScaledClipCheck.__call__)
    total = _original(parameters, *args, **kwargs)
    max_norm = kwargs.get("max_norm", args[0] if args else None)
    norm_type = kwargs.get("norm_type", args[1] if len(args) > 1 else 2.0)
    for observer in _observers:
        observer(params, total, max_norm, norm_type)  # observers never raise either
    return total


def clipped_norm(total: torch.Tensor, max_norm: float | torch.Tensor) -> torch.Tensor:
    """The gradients' total norm after `clip_grad_norm_(..., max_norm)` scaled them, from
    the norm it returned: torch multiplies every gradient by min(1, max_norm / (total +
    1e-6)) (`_clip_grads_with_norm_`), and a norm is homogeneous. An Inf total gives a
    coefficient of 0 and Inf x 0 = NaN gradients, a NaN total NaN ones: NaN either way,
    which is what the clipped gradients hold. (Not covered: finite gradients whose float32
    norm overflows to Inf are zeroed by that clip, and this says NaN.)"""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return total * coef


def _install() -> None:
    global _original
    if _original is None:
        _original = torch.nn.utils.clip_grad_norm_
        wrapped = functools.wraps(_original)(_wrapper)
        torch.nn.utils.clip_grad_norm_ = wrapped
        _clip_grad_module.clip_grad_norm_ = wrapped


def _uninstall_if_unused() -> None:
    global _original
    if not _checkers and not _observers and _original is not None:
        torch.nn.utils.clip_grad_norm_ = _original
        _clip_grad_module.clip_grad_norm_ = _original
        _original = None


def _add(registry: list[Any], item: Any) -> Callable[[], None]:
    _install()
    registry.append(item)

    def unregister() -> None:
        if item in registry:
            registry.remove(item)
        _uninstall_if_unused()

    return unregister


def register(check: Check) -> Callable[[], None]:
    """Install the wrapper (first registration) and return the function that unregisters."""
    return _add(_checkers, check)


def observe(observer: Observer) -> Callable[[], None]:
    """As `register`, for an observer of what each clip returned."""
    return _add(_observers, observer)


class ScaledClipCheck:
    """Calls `report()` once per step in which clipping touched still-scaled gradients."""

    def __init__(
        self,
        scaler: torch.amp.GradScaler,
        optimizers: list[torch.optim.Optimizer],
        report: Callable[[list[str]], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self._scaler = scaler
        self._optimizers = optimizers
        self._report = report
        self._on_error = on_error

    def __call__(self, params: list[torch.Tensor]) -> None:
        try:
            clipped = {id(p) for p in params}
            scaled = [
                type(opt).__qualname__
                for opt in self._optimizers
                if self._still_scaled(opt)
                and any(id(p) in clipped for g in opt.param_groups for p in g["params"])
            ]
            if scaled:
                self._report(scaled)
        except Exception as exc:  # noqa: BLE001 - the agent never raises into the training loop
            self._on_error(exc)

    def _still_scaled(self, optimizer: torch.optim.Optimizer) -> bool:
        # No scale yet means no scaled backward yet; a missing entry means READY
        # (the states are a defaultdict, read without creating one).
        if self._scaler._scale is None:
            return False
        state = self._scaler._per_optimizer_states.get(id(optimizer))
        return state is None or state["stage"] is OptState.READY
