"""Detects `clip_grad_norm_` applied to gradients that are still scaled (before `unscale_`).

Clipping scaled gradients clips against a threshold S times too small (or, as S changes,
by a moving amount): DESIGN's canonical order is backward(S·L) → unscale_ → clip → step.
A GradScaler marks each optimizer's stage in `_per_optimizer_states[id(opt)]["stage"]`:
READY until `unscale_` (or `step`) in the iteration, so a clip that touches a parameter of
a watched optimizer whose stage is READY, while its grads carry the scale, is the bug.

`clip_grad_norm_` is a plain function looked up on its module at call time, so the only
way to see the call without the user's help is to replace that attribute. The replacement
is narrow: one wrapper shared by every live handle, installed when the first registers and
the original object put back, unchanged, when the last one leaves. A loop that imported
the function by name before `watch()` (`from torch.nn.utils import clip_grad_norm_`)
keeps the original and goes unchecked.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.utils.clip_grad as _clip_grad_module
from torch.amp.grad_scaler import OptState

#: Checkers of live handles: each gets the parameters being clipped.
_checkers: list[Callable[[list[torch.Tensor]], None]] = []
_original: Callable[..., torch.Tensor] | None = None


def _wrapper(parameters: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    assert _original is not None
    if isinstance(parameters, torch.Tensor):
        params = [parameters]
    else:
        parameters = params = list(parameters)  # a generator must reach the original intact
    for check in _checkers:
        check(params)  # checkers never raise (see ScaledClipCheck.__call__)
    return _original(parameters, *args, **kwargs)


def register(check: Callable[[list[torch.Tensor]], None]) -> Callable[[], None]:
    """Install the wrapper (first registration) and return the function that unregisters."""
    global _original
    if not _checkers:
        _original = torch.nn.utils.clip_grad_norm_
        wrapped = functools.wraps(_original)(_wrapper)
        torch.nn.utils.clip_grad_norm_ = wrapped
        _clip_grad_module.clip_grad_norm_ = wrapped
    _checkers.append(check)

    def unregister() -> None:
        global _original
        if check in _checkers:
            _checkers.remove(check)
        if not _checkers and _original is not None:
            torch.nn.utils.clip_grad_norm_ = _original
            _clip_grad_module.clip_grad_norm_ = _original
            _original = None

    return unregister


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
        except Exception as exc:
            self._on_error(exc)

    def _still_scaled(self, optimizer: torch.optim.Optimizer) -> bool:
        # No scale yet means no scaled backward yet; a missing entry means READY
        # (the states are a defaultdict, read without creating one).
        if self._scaler._scale is None:
            return False
        state = self._scaler._per_optimizer_states.get(id(optimizer))
        return state is None or state["stage"] is OptState.READY
