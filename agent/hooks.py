"""Forward hooks: the final-layer activation norm (which module, and the hook that measures
it), the optional per-leaf-module activation max-abs, and the precision probe.

OPT-175B's divergences came with a spike in the L2 norm of the final layer's activations
(metaseq logs it as `actv_norm`, the norm of the final hidden state per token).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ampwatch.agent.compiled import tracing


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

    Under `torch.compile` the hook is traced into the model's graph, and every Python value
    it reads becomes a guard: a count or an "is this the first micro-batch" test that
    changes per micro-batch recompiled the graph each time (8 graphs for 4 micro-batches,
    and past dynamo's recompile limit the model ran eagerly). So the step's running sum,
    micro-batch count and max are device tensors, made once and updated in place (their
    values are graph inputs, not guards), and the only Python state the hook touches is a
    flag it sets and never reads; `take()` swaps in fresh tensors, which matches the same
    guards. In eager mode the figures are the same to the bit: the sum starts at an exact
    0 and the count is exact in float32.
    """

    def __init__(self, on_error: Callable[[BaseException], None]) -> None:
        self._on_error = on_error
        self._device = torch.device("cpu")
        self._sum, self._count, self._max = _accumulators(self._device)
        self._seen = False

    def attach(self, module: nn.Module, measure_input: bool) -> RemovableHandle:
        tensor = next(itertools.chain(module.parameters(), module.buffers()), None)
        if tensor is not None:
            self._device = tensor.device
            self._sum, self._count, self._max = _accumulators(self._device)
        if measure_input:
            return module.register_forward_pre_hook(self._pre_hook)
        return module.register_forward_hook(self._hook)

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Return (mean, max) device scalars since the last take, or None, and reset."""
        seen, total, count, peak = self._seen, self._sum, self._count, self._max
        self._seen = False
        self._sum, self._count, self._max = _accumulators(self._device)
        if not seen:
            return None
        return total / count, peak

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
            if value.device != self._device:  # the model moved after watch()
                self._device = value.device
                self._sum, self._count, self._max = (
                    t.to(value.device) for t in (self._sum, self._count, self._max)
                )
            norms = torch.linalg.vector_norm(value.detach(), dim=-1, dtype=torch.float32)
            self._sum.add_(norms.mean())
            self._count.add_(1)
            torch.maximum(self._max, norms.amax(), out=self._max)
            self._seen = True
        except Exception as exc:  # noqa: BLE001 - never let the agent break a forward pass
            self._on_error(exc)


def _accumulators(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's (sum, count, max) for `ActivationNorm`: 0, 0, -inf in float32."""
    zero = torch.zeros((), dtype=torch.float32, device=device)
    return zero, zero.clone(), torch.full((), -math.inf, dtype=torch.float32, device=device)


class PrecisionProbe:
    """Looks once, during the first graph-building forward, at what the parameters cannot
    show: the autocast dtype in effect (`torch.get_autocast_dtype`), and Transformer Engine
    modules running FP8 (their `fp8` flag, set inside their forward when `te.autocast`
    enables it, so read after a forward). Reports (code, detail) pairs, then removes itself.

    The autocast check runs in a forward pre-hook of every leaf module as well as in the
    root's forward hook: HF models and accelerate enter autocast inside `model.forward`
    (it has exited by the time the root's hook runs), and Lightning's `training_step` may
    call a submodule, so the root's forward never runs at all. The hooks go at the end of
    the first root forward, or at the first optimizer step (`finish()`), whichever is first.
    """

    def __init__(
        self,
        device_type: str,
        report: Callable[[str, dict[str, Any]], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self._device_type = device_type
        self._report = report
        self._on_error = on_error
        self._handles: list[RemovableHandle] = []
        self._model: nn.Module | None = None
        self._autocast_seen = False
        #: Whether dynamo traced one of its hooks: the model was compiled after watch().
        self.traced = False

    def attach(self, model: nn.Module, root: nn.Module | None = None) -> None:
        """Hook `model`'s leaves and its root; with `root` (a `torch.compile` wrapper, whose
        own hooks run outside the graph), that root only: leaf hooks traced into a compiled
        graph would learn nothing (`compiled.tracing()`) and recompile it when removed."""
        self._model = model
        if root is not None:
            self._handles.append(root.register_forward_hook(self._root_hook))
            return
        self._handles.append(model.register_forward_hook(self._root_hook))
        for module in model.modules():
            if module is not model and next(module.children(), None) is None:
                self._handles.append(module.register_forward_pre_hook(self._leaf_hook))

    def finish(self) -> None:
        """Report FP8 modules that ran and remove every hook (idempotent)."""
        if not self._handles:
            return
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        try:
            assert self._model is not None
            fp8 = [n for n, m in self._model.named_modules() if getattr(m, "fp8", False) is True]
            if fp8:
                self._report("fp8_modules", {"modules": fp8})
        except Exception as exc:  # noqa: BLE001 - the agent never raises into the training loop
            self._on_error(exc)

    def _check_autocast(self) -> None:
        if not self._autocast_seen and torch.is_autocast_enabled(self._device_type):
            self._autocast_seen = True
            dtype = torch.get_autocast_dtype(self._device_type)
            self._report("autocast", {"device_type": self._device_type, "dtype": dtype})

    def _leaf_hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if tracing():
            self.traced = True  # set, never read, in the trace: no guard
            return
        if not torch.is_grad_enabled():
            return
        try:
            self._check_autocast()
        except Exception as exc:  # noqa: BLE001 - the agent never raises into the training loop
            self._on_error(exc)

    def _root_hook(self, model: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if tracing() or not torch.is_grad_enabled():
            return
        try:
            self._check_autocast()
        except Exception as exc:  # noqa: BLE001 - the agent never raises into the training loop
            self._on_error(exc)
        self.finish()


#: The label of the model itself when it is its own only leaf (its module path is "").
ROOT_MODULE = "(model)"


class ActivationMaxAbs:
    """Max |output| of every leaf module over the forwards of a sampled step, in fp32.

    FP16 overflows at 65504 and FP8 E4M3 at 448: an activation's headroom is its max-abs
    against those. The forward hooks exist only while a sampled step runs (`arm()` after
    the previous step, `take()` at its end removes them), so unsampled steps pay nothing.
    Each hook launches one device reduction (`vector_norm(ord=inf)`: max |x|, computed in
    fp32; exact, since it selects one element and fp16/bf16 widen to fp32 exactly) and
    folds micro-batches by `maximum`, on the device: no host sync. Only forwards that build
    a graph count, as for `ActivationNorm`.
    """

    def __init__(self, model: nn.Module, on_error: Callable[[BaseException], None]) -> None:
        self._on_error = on_error
        self._leaves = [
            (name or ROOT_MODULE, module)
            for name, module in model.named_modules()
            if next(module.children(), None) is None
        ]
        self._handles: list[RemovableHandle] = []
        self._peaks: dict[str, torch.Tensor] = {}

    def arm(self) -> None:
        """Hook every leaf module for the next step (no-op when already armed)."""
        if self._handles:
            return
        for name, module in self._leaves:
            self._handles.append(module.register_forward_hook(self._hook_for(name)))

    def disarm(self) -> None:
        """Remove the hooks; what they measured is dropped (detach calls this)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._peaks = {}

    def take(self) -> tuple[list[str], torch.Tensor] | None:
        """(module paths, their max-abs as one fp32 device tensor) since `arm()`, or None
        when no hooked module ran; disarms."""
        peaks = self._peaks
        self.disarm()
        if not peaks:
            return None
        return list(peaks), torch.stack(list(peaks.values()))

    def _hook_for(self, name: str) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if tracing() or not torch.is_grad_enabled():
                return
            try:
                if isinstance(output, (tuple, list)) and output:
                    output = output[0]  # e.g. an nn.LSTM's (output, (h, c))
                if (
                    not isinstance(output, torch.Tensor)
                    or not output.is_floating_point()
                    or output.numel() == 0
                ):
                    return
                peak = torch.linalg.vector_norm(output.detach(), ord=math.inf, dtype=torch.float32)
                old = self._peaks.get(name)
                self._peaks[name] = peak if old is None else torch.maximum(old, peak)
            except Exception as exc:  # noqa: BLE001 - never let the agent break a forward pass
                self._on_error(exc)

        return hook
