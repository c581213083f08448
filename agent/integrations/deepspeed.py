"""DeepSpeed: `watch(engine, run="gpt-small")` on the `DeepSpeedEngine` from
`deepspeed.initialize()`; the loop (`engine(batch)`, `engine.backward(loss)`,
`engine.step()`) runs unchanged.

The engine owns the loss scaler, the accumulation boundaries and clipping, so the agent
watches the engine itself (deepspeed 0.19, read from its source and run here on the CPU):

- `engine.step()` runs on every micro-batch and updates only at an accumulation boundary
  (`is_gradient_accumulation_boundary()`, read before the real step): one record per
  boundary, numbered from `engine.global_steps` (which counts skipped steps too).
- The loss scale and lr in effect are read before the real step (the scaler backs off and
  the scheduler steps inside it): `engine.optimizer.loss_scale` (FP16_UnfusedOptimizer has
  no `cur_scale`; ZeRO's is a property over its scaler; 1.0 under BF16) and
  `engine.get_lr()[0]`. Both are Python numbers: no device read.
- Skipped: `not engine.was_step_applied()` after a boundary step: the engine's own
  `overflow` flag, so a hysteresis step that skips without backing off counts, and so do
  BF16 steps skipped on non-finite gradients. `engine.skipped_steps` counts the same.
- Grad norm: `engine.get_global_grad_norm()` after the step: the norm the optimizer
  computed before clipping (`gradient_clipping`), Inf on an overflow.
- The scaler's floor, sent in run_start: `engine.dynamic_loss_scale_args()["min_scale"]`
  (the fp16 config's `min_loss_scale`, default 1) when FP16 runs with a dynamic scale
  (`engine.fp16_enabled()`, `engine.dynamic_loss_scale()`); none under BF16 or a static
  scale.
- The loss: what the loop gives `engine.backward(loss)`, undivided (the engine divides it
  by `gradient_accumulation_steps`), averaged over the step's micro-batches.
- Layer statistics, on sampled boundary steps, just before the real step: ZeRO stage 0
  from each parameter's `.grad`; stages 1, 2 and 3 from `deepspeed.utils.
  safe_get_full_grad(param)` (the fp32 gradient the optimizer will use, carrying the loss
  scale, which is divided back out; stage 3 gathers each partition, a collective every
  rank runs on the same sampled steps). Stage 0's `.grad` carries no loss scale in 0.19
  (its `engine.backward` does not scale for the unfused FP16 optimizer); the statistics
  take the scale in effect for the FP16 forecast either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ampwatch.agent import WatchHandle
from ampwatch.agent import watch as watch_model
from ampwatch.agent.patch import patch_method
from ampwatch.agent.stats import Grads

__all__ = ["watch"]


def watch(engine: Any, **watch_kwargs: Any) -> WatchHandle:
    """Attach to a DeepSpeedEngine; keyword arguments are `ampwatch.agent.watch()`'s.

    >>> engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)  # doctest: +SKIP
    >>> handle = watch(engine, run="gpt-small")  # doctest: +SKIP
    """
    from deepspeed import DeepSpeedEngine

    if not isinstance(engine, DeepSpeedEngine):
        raise TypeError(
            "ampwatch.integrations.deepspeed.watch() takes the DeepSpeedEngine that "
            f"deepspeed.initialize() returns, got {type(engine).__name__}"
        )
    for owned in ("start_step", "optimizer", "scaler", "min_loss_scale"):
        if owned in watch_kwargs:
            raise TypeError(f"watch(engine) sets {owned} itself from the engine")
    handle = watch_model(engine.module, None, None, start_step=engine.global_steps,
                         min_loss_scale=min_loss_scale(engine), **watch_kwargs)  # fmt: skip
    tap = _EngineTap(engine, handle)
    tap.attach()
    handle._detach_actions.insert(0, tap.detach)
    return handle


def min_loss_scale(engine: Any) -> float | None:
    """The floor of the engine's dynamic FP16 loss scaler (None: BF16, FP32 or a static
    scale, whose scale never moves). Read from the engine's config, which every FP16
    optimizer (FP16_Optimizer, FP16_UnfusedOptimizer, ZeRO) builds its scaler from."""
    if not (engine.fp16_enabled() and engine.dynamic_loss_scale()):
        return None
    floor = engine.dynamic_loss_scale_args().get("min_scale")
    is_number = isinstance(floor, (int, float)) and not isinstance(floor, bool)
    return float(floor) if is_number and floor > 0 else None


def _loss_scale(optimizer: Any) -> float | None:
    for name in ("loss_scale", "cur_scale"):
        value = getattr(optimizer, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


class _EngineTap:
    """Patches `backward` and `step` on one engine instance and restores them exactly."""

    def __init__(self, engine: Any, handle: Any) -> None:
        self._engine = engine
        self._handle = handle
        self._restores: list[Callable[[], None]] = []
        self._stage = int(engine.zero_optimization_stage())

    def attach(self) -> None:
        for name, make in (("backward", self._backward), ("step", self._step)):
            self._restores.append(patch_method(self._engine, name, make))

    def detach(self) -> None:
        for restore in reversed(self._restores):
            restore()
        self._restores.clear()

    def _backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._handle.log_loss(loss)  # never raises
            return original(loss, *args, **kwargs)

        return backward

    def _step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            before = self._before_step()
            result = original(*args, **kwargs)
            if before is not None:
                self._after_step(*before)
            return result

        return step

    def _before_step(self) -> tuple[float | None, float | None, Any] | None:
        handle = self._handle
        try:
            engine = self._engine
            if not engine.is_gradient_accumulation_boundary():
                return None
            scale = _loss_scale(engine.optimizer)
            lrs = engine.get_lr()
            lr = float(lrs[0]) if lrs else None
            return scale, lr, self._layers(handle._step + 1, scale)
        except Exception as exc:  # noqa: BLE001 - the agent never raises into the training loop
            handle._on_error(exc)
            return None

    def _after_step(self, scale: float | None, lr: float | None, layers: Any) -> None:
        handle = self._handle
        try:
            engine = self._engine
            norm = engine.get_global_grad_norm()
            handle.record(
                loss_scale=scale,
                skipped=not engine.was_step_applied(),
                grad_norm=norm if isinstance(norm, (torch.Tensor, float, int)) else None,
                lr=lr,
            )
            if layers is not None:
                handle._send(layers)
        except Exception as exc:  # noqa: BLE001 - the agent never raises into the training loop
            handle._on_error(exc)

    def _layers(self, step: int, scale: float | None) -> Any:
        """The sampled step's range statistics from the gradients the optimizer will use."""
        handle = self._handle
        if (step - 1) % handle._every:
            return None
        named = list(self._engine.module.named_parameters())
        if self._stage == 0:
            grads = [(n, p.grad) for n, p in named]
            divide = 1.0
        else:
            from deepspeed.utils import safe_get_full_grad

            grads = [(n, safe_get_full_grad(p)) for n, p in named]
            divide = scale or 1.0
        names = [n for n, g in grads if g is not None and g.numel()]
        tensors = [
            g.detach() / divide if divide != 1.0 else g.detach()
            for _, g in grads
            if g is not None and g.numel()
        ]
        device_scale = None
        if tensors and scale is not None:
            device_scale = torch.tensor(scale, dtype=torch.float32, device=tensors[0].device)
        return handle._layer_sample(step, Grads(names, tensors, len(tensors)), device_scale)
