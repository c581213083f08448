"""accelerate: `watch(model, optimizer, accelerator=accelerator)`.

`accelerator.prepare()` returns an `AcceleratedOptimizer` (the real optimizer is its
`.optimizer`, the GradScaler, when FP16 is on a device that has one, its `.scaler`) and a
model whose `forward` enters autocast itself; `watch()` unwraps both. One record per real
optimizer step: `AcceleratedOptimizer.step()` runs on every micro-batch of
`accelerator.accumulate()` but steps the optimizer (and the scaler) only when gradients
sync, and the agent hooks the optimizer (or the scaler) it steps.

`accelerator.backward(loss)` divides the loss by `gradient_accumulation_steps` before
backward; the tap here logs the loss it was given, undivided, so the stored loss is the
mean micro-batch loss, as the user computed it. On the CPU accelerate builds no scaler
(FP16 there is bf16-only autocast): the tests set a `torch.amp.GradScaler("cpu")` on the
accelerator to reach the FP16 path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ampwatch.agent.patch import patch_method


def tap_backward(accelerator: Any, handle: Any) -> Callable[[], None]:
    """Patch `backward` on this accelerator instance to log each micro-batch's loss first;
    return the function that puts the original back (detach calls it)."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def backward(loss: Any, **kwargs: Any) -> Any:
            handle.log_loss(loss)  # never raises; a tensor: no host sync
            return original(loss, **kwargs)

        return backward

    return patch_method(accelerator, "backward", make)
