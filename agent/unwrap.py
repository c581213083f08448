"""What `watch()` accepts: the user's model and optimizer, or the wrappers frameworks put
around them, unwrapped to the objects the agent hooks.

Frameworks hand their users wrappers: accelerate's `AcceleratedOptimizer` (`.optimizer`,
and its `.scaler`), Lightning's `LightningOptimizer` (`._optimizer`), DDP / DataParallel
(`.module`), `torch.compile`'s `OptimizedModule` (`._orig_mod`). A wrapper's own attributes
are not an optimizer's (`_optimizer_step_pre_hooks`), so hooking one raised from inside the
agent; unwrapping here keeps the hooks on the object that really steps, and parameter names
as the user's model names them. Anything else is a `TypeError` that says what is supported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

#: Attributes under which known wrappers keep the optimizer they step, outermost first.
_OPTIMIZER_ATTRIBUTES = ("optimizer", "_optimizer")
#: Wrappers nest (an AcceleratedOptimizer around a LightningOptimizer); never loop forever.
_MAX_DEPTH = 4

SUPPORTED_OPTIMIZERS = (
    "a torch.optim.Optimizer, a list of them, accelerate's AcceleratedOptimizer or "
    "Lightning's LightningOptimizer (unwrapped to the optimizer they step), or None "
    "(record steps with handle.record())"
)
SUPPORTED_MODELS = (
    "a torch.nn.Module (DDP, DataParallel and torch.compile wrappers are unwrapped to the "
    "module they run; a DeepSpeedEngine needs ampwatch.integrations.deepspeed)"
)


def unwrap_optimizer(optimizer: object) -> torch.optim.Optimizer:
    """The torch optimizer inside `optimizer` (itself if it is one); TypeError otherwise.

    >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    >>> unwrap_optimizer(opt) is opt
    True
    """
    current = optimizer
    for _ in range(_MAX_DEPTH):
        # AcceleratedOptimizer subclasses Optimizer without its __init__ (no hook dicts),
        # and a LightningOptimizer takes on its optimizer's class: an inner optimizer wins
        # over the wrapper's own isinstance.
        inner = next(
            (
                getattr(current, name)
                for name in _OPTIMIZER_ATTRIBUTES
                if isinstance(getattr(current, name, None), torch.optim.Optimizer)
            ),
            None,
        )
        if inner is None:
            break
        current = inner
    if isinstance(current, torch.optim.Optimizer):
        return current
    raise TypeError(f"optimizer must be {SUPPORTED_OPTIMIZERS}, got {type(optimizer).__name__}")


def wrapped_scaler(optimizer: object) -> torch.amp.GradScaler | None:
    """The GradScaler an accelerate `AcceleratedOptimizer` steps through, if any."""
    scaler: Any = getattr(optimizer, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) else None


def unwrap_model(model: object) -> nn.Module:
    """The module a DDP / DataParallel / torch.compile wrapper runs (hooks on it fire when
    the wrapper calls it, and its parameter names carry no `module.` prefix).

    >>> net = nn.Linear(2, 2)
    >>> unwrap_model(nn.DataParallel(net)) is net
    True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be {SUPPORTED_MODELS}, got {type(model).__name__}")
    if type(model).__name__ == "DeepSpeedEngine":
        raise TypeError(
            "a DeepSpeedEngine owns its loss scaler and accumulation boundaries: attach with "
            "ampwatch.integrations.deepspeed.watch(engine, ...)"
        )
    current = model
    for _ in range(_MAX_DEPTH):
        if isinstance(current, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            current = current.module
        elif isinstance(getattr(current, "_orig_mod", None), nn.Module):  # torch.compile
            current = cast(nn.Module, current._orig_mod)
        else:
            break
    return current


def watched_objects(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
    scaler: torch.amp.GradScaler | None,
    accelerator: Any,
) -> tuple[nn.Module, list[torch.optim.Optimizer], torch.amp.GradScaler | None]:
    """The module the model runs, the torch optimizers, and the scaler: the one given, else
    the one a wrapped optimizer steps through, else the accelerator's."""
    optimizers = _optimizer_list(optimizer)
    if scaler is None:
        scaler = next((s for o in _as_list(optimizer) if (s := wrapped_scaler(o))), None)
    if accelerator is not None and scaler is None:
        scaler = getattr(accelerator, "scaler", None)
    return unwrap_model(model), optimizers, scaler


def _as_list(optimizer: object) -> list[object]:
    if optimizer is None:
        return []
    if isinstance(optimizer, Sequence) and not isinstance(optimizer, str):
        return list(optimizer)
    return [optimizer]


def _optimizer_list(optimizer: object) -> list[torch.optim.Optimizer]:
    """The torch optimizers to hook, unwrapped; TypeError naming what is supported."""
    try:
        return [unwrap_optimizer(o) for o in _as_list(optimizer)]
    except TypeError:
        raise TypeError(
            f"optimizer must be {SUPPORTED_OPTIMIZERS}, got {type(optimizer).__name__}"
        ) from None
