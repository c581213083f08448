"""The manual API: `handle.record(...)` for loops whose loss scaler is not torch's GradScaler.

Attach without an optimizer (nothing is then recorded automatically; the final-layer
activation norm still is) and call `record()` once per optimizer step, after the step.
Every argument is optional and may be a Python number or a tensor: numbers are taken as
they are, tensors are stacked and copied to the host without a sync, like the automatic
path's. `record()` never raises; a bad value is logged once and counted as a hook error.
`step` defaults to the previous step + 1; pass a Python int, not a tensor.
A scaler with a floor: pass it as `watch(..., min_loss_scale=...)` (fairseq's
`--min-loss-scale`, default 1e-4; Megatron's `--min-loss-scale`, default 1; DeepSpeed's
integration reads the engine's), so that the scale rules judge a low scale against it.

Per framework (attribute names from `shared/reference/loss-scalers.md`; the DeepSpeed one
is run by tests/integrations/test_deepspeed.py, Megatron's scaler by
tests/agent/test_megatron.py, the others were read from each project's source at the
commits cited there, not run here):

DeepSpeed: use `ampwatch.integrations.deepspeed.watch(engine)`, which does this and adds
layer statistics. By hand, record once per accumulation boundary, reading the scale and lr
in effect BEFORE `engine.step()` (it backs the scale off and steps the scheduler), and the
skip after it (`engine.optimizer.loss_scale` exists on FP16_UnfusedOptimizer and ZeRO
alike; `cur_scale` does not on the former)::

    handle = watch(engine.module)
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        handle.log_loss(loss)              # undivided: the engine divides by the GAS
        boundary = engine.is_gradient_accumulation_boundary()
        scale, lr = engine.optimizer.loss_scale, engine.get_lr()[0]
        engine.step()
        if boundary:
            handle.record(loss_scale=scale, lr=lr, skipped=not engine.was_step_applied(),
                          grad_norm=engine.get_global_grad_norm())

fairseq / metaseq (the trainer catches `OverflowError` from the FP16 optimizer and skips;
`trainer.get_loss_scale()`-style accessors vary by version: `trainer.optimizer.scaler
.loss_scale` is the value they log as `loss_scale`; unverified against a running trainer)::

    handle = watch(model, min_loss_scale=cfg.common.min_loss_scale)  # fairseq stops there
    skipped = False
    try:
        trainer.optimizer.step()
    except OverflowError:
        skipped = True
    handle.record(loss=loss, loss_scale=trainer.optimizer.scaler.loss_scale, skipped=skipped)

Megatron-LM (`optimizer.get_loss_scale()` returns a device tensor: pass it as is, no sync;
`optimizer.step()` returns (update_successful, grad_norm, num_zeros_in_grad); read the
scale before `step()`, which updates it. megatron-core 0.16.1, the last release for
Python 3.11, imports on the CPU, but `MegatronGradScaler.__init__` allocates its scale
with `device='cuda'`: tests/agent/test_megatron.py runs its `DynamicGradScaler` with that
scale on the CPU, where megatron-core is installed)::

    handle = watch(model, min_loss_scale=args.min_loss_scale)  # the scaler clamps at it
    loss_scale = optimizer.get_loss_scale()

    update_successful, grad_norm, _ = optimizer.step()
    handle.record(loss=loss, loss_scale=loss_scale,
                  skipped=not update_successful, grad_norm=grad_norm,
                  lr=optimizer.param_groups[0]["lr"])

Apex amp (legacy; `amp._amp_state.loss_scalers[0].loss_scale()` is a Python float and
the scaler's `_has_overflow` is set by `scale_loss` exit; private, unverified)::

    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    scaler = amp._amp_state.loss_scalers[0]
    optimizer.step()
    handle.record(loss=loss.detach(), loss_scale=scaler.loss_scale(),
                  skipped=scaler._has_overflow)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ampwatch.agent.records import StepSample
from ampwatch.agent.shards import whole_scalar

ToHost = Callable[[torch.Tensor], tuple[torch.Tensor, "torch.cuda.Event | None"]]


def manual_sample(
    step: int, rank: int, values: Mapping[str, object], to_host: ToHost
) -> StepSample:
    """A StepSample from mixed numbers and tensors (None = not measured). `found_inf` is
    the skip: a bool, a number or a tensor, > 0 meaning skipped. A number that is not
    `int`/`float`/`bool` raises TypeError (counted by the caller)."""
    host: dict[str, float | None] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, torch.Tensor):
            if (local := whole_scalar(value)) is None:  # a shard, or not one element
                raise TypeError(f"record({name}=...) takes a one-element tensor every rank holds")
            tensors[name] = local
        elif isinstance(value, (bool, int, float)):
            host[name] = float(value)
        else:
            raise TypeError(f"record({name}=...) takes a number or a tensor, got {type(value)}")
    stacked: torch.Tensor | None = None
    ready = None
    if tensors:
        device = next(iter(tensors.values())).device
        stacked, ready = to_host(
            torch.stack([t.to(device, torch.float32, non_blocking=True) for t in tensors.values()])
        )
    return StepSample(step, rank, tuple(tensors), stacked, ready, host)
