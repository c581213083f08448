"""The final-layer activation norm: which module to watch, and the forward hook that measures it.

OPT-175B's divergences came with a spike in the L2 norm of the final layer's activations
(metaseq logs it as `actv_norm`, the norm of the final hidden state per token).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ampwatch.agent.stats import RunningMean


def find_final_layer(model: nn.Module, name: str | None) -> tuple[str, nn.Module, bool] | None:
    """Return (module name, module, measure its input?) for the activation-norm hook.

    Without `name`: the model's last `nn.Linear` in `named_modules()` order, taken to be the
    output head; its INPUT is the final hidden state. With `name`: that module's OUTPUT.
    Returns None when the model has no `nn.Linear` and no name was given.
    """
    modules = dict(model.named_modules())
    if name is not None:
        if name not in modules:
            valid = [n for n in modules if n][-10:]
            raise ValueError(
                f"final_layer={name!r} is not a module of the model; pass a name from "
                f"model.named_modules(), e.g. one of {valid}"
            )
        return name, modules[name], False
    linears = [(n, m) for n, m in modules.items() if isinstance(m, nn.Linear)]
    if not linears:
        return None
    head_name, head = linears[-1]
    return head_name, head, True


class ActivationNorm:
    """Accumulates mean and max over tokens of the fp32 L2 norm over the last dimension.

    Only forwards that build a graph are measured: evaluation under `torch.no_grad()` must not
    move the training signal. Micro-batches of one step are averaged (mean) and maxed (max).
    """

    def __init__(self, on_error: Callable[[BaseException], None]) -> None:
        self._on_error = on_error
        self._mean = RunningMean()
        self._max: torch.Tensor | None = None

    def attach(self, module: nn.Module, measure_input: bool) -> RemovableHandle:
        if measure_input:
            return module.register_forward_pre_hook(self._pre_hook)
        return module.register_forward_hook(self._hook)

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Return (mean, max) device scalars since the last take, or None, and reset."""
        mean, peak = self._mean.take(), self._max
        self._max = None
        if mean is None or peak is None:
            return None
        return mean, peak

    def _pre_hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if args:
            self._observe(args[0])

    def _hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._observe(output)

    def _observe(self, value: Any) -> None:
        if not torch.is_grad_enabled():
            return
        try:
            if isinstance(value, (tuple, list)) and value:
                value = value[0]  # e.g. a transformer block returning (hidden, attn)
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                return
            norms = torch.linalg.vector_norm(value.detach(), dim=-1, dtype=torch.float32)
            self._mean.add(norms.mean())
            peak = norms.amax()
            self._max = peak if self._max is None else torch.maximum(self._max, peak)
        except Exception as exc:  # never let the agent break a forward pass
            self._on_error(exc)
