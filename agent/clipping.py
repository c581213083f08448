"""Detects gradient clipping applied to gradients that are still scaled (before `unscale_`),
and hands each watched loop the norm before its own clip.

Clipping scaled gradients clips against a threshold S times too small (or, as S changes,
by a moving amount): DESIGN's canonical order is backward(S·L) → unscale_ → clip → step.
A GradScaler marks each optimizer's stage in `_per_optimizer_states[id(opt)]["stage"]`:
READY until `unscale_` (or `step`) in the iteration, so a clip that touches a parameter of
a watched optimizer whose stage is READY, while its grads carry the scale, is the bug.

The total norm `clip_grad_norm_` returns is the norm BEFORE clipping, which the loop has
already paid for: observers (`observe`) get it, and the agent stores it as the step's grad
norm instead of a second pass over every gradient. Read after clipping instead, a spike is
stored as the threshold (HF's default `max_grad_norm=1.0` turns every spike into ~1.0).
The norm after that clip follows from the norm and `max_norm` on the device
(`clipped_norm`), without a second pass or a host read.

`clip_grad_value_` (Lightning's `gradient_clip_algorithm="value"`, accelerate's
`clip_grad_value_`) returns nothing, and a norm read after it is the clipped one (Lightning
FP16: 0.281 stored where the norm before the clip was 1.741): the wrapper launches the L2
norm before the clip and the one after it (`torch.nn.utils.get_total_norm`, as
`clip_grad_norm_` computes it; two passes, no host read), and observers get both.

The same clip in two calls, `get_total_norm` then `clip_grads_with_norm_(params, max_norm,
total_norm)`, is how accelerate >= 1.16 (and so the HF Trainer) and torchtitan clip: the
norm handed to the second call is the norm before the clip, and the first call's
`norm_type` says which norm it is (`_two_step_wrapper`; an L2 norm is assumed only when
`get_total_norm` was seen with 2). torch's own `clip_grad_norm_` calls the private
`_clip_grads_with_norm_`, so one clip is never observed twice.

The clips are plain functions looked up on their module at call time, so the only way to
see the call without the user's help is to replace that attribute. The replacement is
narrow: one wrapper per function shared by every live handle, installed when the first
registers and the original objects put back, unchanged, when the last one leaves. A loop
that imported the function by name before `watch()` (`from torch.nn.utils import
clip_grad_norm_`) keeps the original and goes unchecked (Lightning, accelerate and the HF
Trainer look it up on `torch.nn.utils` at call time).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.utils.clip_grad as _clip_grad_module
from torch.amp.grad_scaler import OptState

Check = Callable[[list[torch.Tensor]], None]
#: (parameters clipped, their total norm before the clip, the norm after it or None where
#: unknown, the norm's type)
Observer = Callable[[list[torch.Tensor], torch.Tensor, torch.Tensor | None, Any], None]

#: Checkers of live handles: each gets the parameters being clipped, before the clip.
_checkers: list[Check] = []
#: Observers of live handles: each gets the norms before and after a clip, after it.
_observers: list[Observer] = []
#: The replaced functions, by name in `torch.nn.utils`, while a wrapper is installed.
_originals: dict[str, Callable[..., Any]] = {}


def _params(parameters: Any) -> tuple[Any, list[torch.Tensor]]:
    """(what to pass on, the parameters as a list): a generator must reach the original
    intact, so it is passed on as the list."""
    if isinstance(parameters, torch.Tensor):
        return parameters, [parameters]
    params = list(parameters)
    return params, params


def _norm_wrapper(parameters: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    parameters, params = _params(parameters)
    for check in _checkers:
        check(params)  # checkers never raise (see ScaledClipCheck.__call__)
    total: torch.Tensor = _originals["clip_grad_norm_"](parameters, *args, **kwargs)
    max_norm = kwargs.get("max_norm", args[0] if args else None)
    norm_type = kwargs.get("norm_type", args[1] if len(args) > 1 else 2.0)
    if _observers:
        after = None
        if isinstance(max_norm, (int, float, torch.Tensor)):
            after = clipped_norm(total.detach(), max_norm)
        for observer in _observers:
            observer(params, total, after, norm_type)  # observers never raise either
    return total


#: The `norm_type` of the last `get_total_norm` call, which the two-step clip's second call
#: (`clip_grads_with_norm_`) does not repeat; None once consumed or never seen.
_last_norm_type: list[Any] = [None]


def _total_norm_wrapper(tensors: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    _last_norm_type[0] = kwargs.get("norm_type", args[0] if args else 2.0)
    total: torch.Tensor = _originals["get_total_norm"](tensors, *args, **kwargs)
    return total


def _two_step_wrapper(
    parameters: Any, max_norm: Any, total_norm: Any, *args: Any, **kwargs: Any
) -> None:
    parameters, params = _params(parameters)
    for check in _checkers:
        check(params)
    _originals["clip_grads_with_norm_"](parameters, max_norm, total_norm, *args, **kwargs)
    norm_type, _last_norm_type[0] = _last_norm_type[0], None
    if _observers and isinstance(total_norm, torch.Tensor):
        after = None
        if isinstance(max_norm, (int, float, torch.Tensor)):
            after = clipped_norm(total_norm.detach(), max_norm)
        for observer in _observers:
            observer(params, total_norm, after, norm_type)


def _value_wrapper(parameters: Any, *args: Any, **kwargs: Any) -> None:
    parameters, params = _params(parameters)
    for check in _checkers:
        check(params)
    before = _l2_norm(params) if _observers else None
    _originals["clip_grad_value_"](parameters, *args, **kwargs)
    if before is not None:
        after = _l2_norm(params)
        for observer in _observers:
            observer(params, before, after, 2.0)


def _l2_norm(params: list[torch.Tensor]) -> torch.Tensor | None:
    """The L2 norm over the parameters' gradients, as `clip_grad_norm_` computes it; None
    when it cannot be had (no gradient, or a failure: the clip itself must still run)."""
    try:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads or any(type(g) is not torch.Tensor for g in grads):
            return None  # a DTensor's norm would run a collective: the agent measures its own
        total_norm = _originals.get("get_total_norm", torch.nn.utils.get_total_norm)
        norm: torch.Tensor = total_norm(grads, 2.0)
        return norm
    except Exception:  # noqa: BLE001 - the agent never raises into the training loop
        return None


def clipped_norm(total: torch.Tensor, max_norm: float | torch.Tensor) -> torch.Tensor:
    """The gradients' total norm after `clip_grad_norm_(..., max_norm)` scaled them, from
    the norm it returned: torch multiplies every gradient by min(1, max_norm / (total +
    1e-6)) (`_clip_grads_with_norm_`), and a norm is homogeneous. An Inf total gives a
    coefficient of 0 and Inf x 0 = NaN gradients, a NaN total NaN ones: NaN either way,
    which is what the clipped gradients hold. (Not covered: finite gradients whose float32
    norm overflows to Inf are zeroed by that clip, and this says NaN.)"""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return total * coef


_WRAPPERS: dict[str, Callable[..., Any]] = {
    "clip_grad_norm_": _norm_wrapper,
    "clip_grad_value_": _value_wrapper,
    "get_total_norm": _total_norm_wrapper,
    "clip_grads_with_norm_": _two_step_wrapper,
}


def _modules(name: str) -> list[Any]:
    """Where `name` is looked up: `torch.nn.utils`, and the clip module where it has the
    same name there (the two-step functions are private names in it, which torch's own
    `clip_grad_norm_` calls and which stay unwrapped)."""
    return [torch.nn.utils] + ([_clip_grad_module] if hasattr(_clip_grad_module, name) else [])


def _install() -> None:
    for name, wrapper in _WRAPPERS.items():
        if name not in _originals and hasattr(torch.nn.utils, name):
            _originals[name] = original = getattr(torch.nn.utils, name)
            wrapped = functools.wraps(original)(wrapper)
            for module in _modules(name):
                setattr(module, name, wrapped)


def _uninstall_if_unused() -> None:
    if not _checkers and not _observers:
        for name, original in _originals.items():
            for module in _modules(name):
                setattr(module, name, original)
        _originals.clear()


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
