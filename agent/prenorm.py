"""The activation norm before the final norm: the last block's output, where a divergence
shows.

The default activation-norm hook (`hooks.find_final_layer`) reads the head's input, the
final hidden state after the model's final LayerNorm / RMSNorm, which normalises it: on the
scenario suite's lr blow-up it reached x2 its rolling median at step 155, the value before
the norm at 146 (tests/scenarios/test_scenarios.py). The same L2 norm
(mean and max over tokens, graph-building forwards only: `hooks.ActivationNorm`) of that
final norm's INPUT grows with the residual stream, and is sent besides it as
`act_prenorm_mean` / `act_prenorm_max`.

The final norm is found by name and order: the last module in `named_modules()` before the
head that is an `nn.LayerNorm` / `nn.RMSNorm` or whose class name ends in "LayerNorm" or
"RMSNorm" (HF's LlamaRMSNorm, T5LayerNorm, apex's FusedLayerNorm, ...). None when the model
has none, or when `final_layer=` names the measured module itself.

>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
>>> find_final_norm(model, ("2", model[2], True))[0]
'1'
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ampwatch.agent.hooks import ActivationNorm

_NORMS: tuple[type[nn.Module], ...] = tuple(
    t for t in (nn.LayerNorm, getattr(nn, "RMSNorm", None)) if isinstance(t, type)
)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORMS) or type(module).__name__.endswith(("LayerNorm", "RMSNorm"))


def find_final_norm(
    model: nn.Module, head: tuple[str, nn.Module, bool] | None
) -> tuple[str, nn.Module] | None:
    """(name, module) of the final norm before the auto-detected `head`
    (`hooks.find_final_layer`'s answer), or None."""
    if head is None or not head[2]:  # no head, or final_layer= named the module to measure
        return None
    final: tuple[str, nn.Module] | None = None
    for name, module in model.named_modules():
        if name == head[0]:
            break
        if _is_norm(module):
            final = (name, module)
    return final


def attach_prenorm(
    model: nn.Module,
    head: tuple[str, nn.Module, bool] | None,
    on_error: Callable[[BaseException], None],
    add_hook: Callable[[RemovableHandle], None],
) -> ActivationNorm | None:
    """Hook the final norm's input (through `add_hook`, so detach removes it); None when
    there is no final norm to look before."""
    found = find_final_norm(model, head)
    if found is None:
        return None
    tap = ActivationNorm(on_error)
    add_hook(tap.attach(found[1], measure_input=True))
    return tap


def take_prenorm(
    tap: ActivationNorm | None, into: dict[str, torch.Tensor] | dict[str, object]
) -> None:
    """Put the step's pre-norm (mean, max) into a step's values, if measured."""
    if tap is not None and (act := tap.take()) is not None:
        into["act_prenorm_mean"], into["act_prenorm_max"] = act
