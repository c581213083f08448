"""Hugging Face Trainer: `Trainer(..., callbacks=[AmpwatchCallback(run="gpt-small")])`.

What the Trainer does, and what the callback relies on (transformers 5.x, read from its
source): it builds an accelerate `Accelerator`, whose `AcceleratedOptimizer` holds the real
optimizer (`.optimizer`) and, for FP16 on a GPU, the GradScaler (`.scaler`); the callback
gets that optimizer in `on_train_begin` and `watch()` unwraps both. The Trainer clips with
`accelerator.clip_grad_norm_` (`max_grad_norm`, default 1.0, or `inf` just to measure),
which calls `torch.nn.utils.clip_grad_norm_` (accelerate < 1.16) or `get_total_norm` then
`clip_grads_with_norm_` (>= 1.16; both tapped by `agent/clipping.py`): the stored grad norm
is the one it computed, before clipping, which is also what the Trainer logs as `grad_norm`. It steps the optimizer
once per accumulation boundary, then the lr scheduler, so the lr read at the step is the
one in effect.

The loss: the Trainer logs, per optimizer step, the sum of what `training_step` returned
for the step's micro-batches. A model that takes `num_items_in_batch` (GPT-2, Llama, ...)
already returns its micro-batch's share of the step's loss (sum over its tokens / the
step's tokens), and the Trainer divides nothing; otherwise the Trainer divides each
micro-batch's mean loss by the accumulation steps. A forward hook on the model reads
`outputs.loss` and, seeing whether `num_items_in_batch` was passed, the stored loss is the
sum of shares or the mean of micro-batch losses: in both cases the Trainer's own number,
unless a `compute_loss` override changes the loss after the model returns it (the hook
sees the model's loss; such a Trainer can call `callback.handle.log_loss(loss)` itself).

Alert to action (`watch(on_critical="stop")`, `ampwatch.agent.policy`): each checkpoint the
Trainer saves (`on_save`: `output_dir/checkpoint-<step>`) is reported to the advisor; when
the collector reports a critical alert, `on_step_end` sets `control.should_save` and
`control.should_training_stop`, so the Trainer saves through its own checkpoint path and
stops; `callback.exit_code` is then `EXIT_CRITICAL_ALERT` for `sys.exit`. The Trainer
does not agree on `control.should_training_stop` across ranks (each rank breaks out of its
own loop; its EarlyStopping relies on metrics that are the same on every rank), so under
DDP the callback agrees itself: at `on_step_end` of every `AGREE_EVERY`-th step, on every
rank, a one-element `torch.distributed.all_reduce` (MAX) of the ranks' decisions, so every
rank saves (rank 0 reports it) and stops at the same step.

The Trainer has no exception callback: a run that raises ends as `exited` at interpreter
exit (the agent's atexit handler), a finished one as `finished` at `on_train_end`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import TrainerCallback

from ampwatch.agent import EXIT_CRITICAL_ALERT, WatchHandle, watch
from ampwatch.agent.policy import AGREE_EVERY

__all__ = ["AmpwatchCallback"]


class AmpwatchCallback(TrainerCallback):
    """Watch a Hugging Face Trainer run. Keyword arguments are `ampwatch.agent.watch()`'s.

    >>> trainer = Trainer(model, args, callbacks=[AmpwatchCallback(run="gpt")])  # doctest: +SKIP
    """

    def __init__(self, **watch_kwargs: Any) -> None:
        for owned in ("start_step", "loss_reduction", "scaler", "optimizer"):
            if owned in watch_kwargs:
                raise TypeError(f"AmpwatchCallback sets {owned} itself from the Trainer")
        self._watch_kwargs = watch_kwargs
        self.handle: WatchHandle | None = None
        self._loss_hook: torch.utils.hooks.RemovableHandle | None = None
        #: The handle's exit code at detach: `sys.exit(callback.exit_code)` after `train()`.
        self.exit_code = 0
        #: Training stopped for a critical alert (this rank's, or another's under DDP).
        self.stopped = False

    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        if self.handle is not None or model is None:
            return
        handle = watch(model, optimizer, start_step=state.global_step, **self._watch_kwargs)
        self.handle = handle
        self._loss_hook = model.register_forward_hook(self._on_forward, with_kwargs=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._should_stop(args, state):
            control.should_save = True
            control.should_training_stop = True
            self.stopped = True

    def _should_stop(self, args: Any, state: Any) -> bool:
        """This rank's stop decision. Under DDP with `on_critical="stop"`: the MAX over the
        ranks every `AGREE_EVERY` steps (the same steps on every rank, whatever each
        heard), never between."""
        local = self.handle is not None and self.handle.should_stop
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if not distributed or self._watch_kwargs.get("on_critical") != "stop":
            return local
        if torch.distributed.get_world_size() == 1:
            return local
        if state.global_step % AGREE_EVERY != 0:
            return False
        decision = torch.tensor([float(local)], device=args.device)
        torch.distributed.all_reduce(decision, op=torch.distributed.ReduceOp.MAX)
        return bool(decision.item())

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer's own folder name (PREFIX_CHECKPOINT_DIR); every rank saves, rank 0
        # writes the files and reports them.
        if self.handle is not None and state.is_world_process_zero:
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            self.handle.checkpoint(path, state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        handle, self.handle = self.handle, None
        if self._loss_hook is not None:
            self._loss_hook.remove()
            self._loss_hook = None
        if handle is not None:
            self.exit_code = handle.exit_code
            handle.detach("stopped" if handle.should_stop or self.stopped else "finished")
        if self.stopped:  # another rank heard it: this rank stopped for it too
            self.exit_code = EXIT_CRITICAL_ALERT

    def _on_forward(
        self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any
    ) -> None:
        handle = self.handle
        if handle is None or not torch.is_grad_enabled():
            return  # evaluation runs under no_grad
        try:
            loss = getattr(output, "loss", None)
            if loss is None and isinstance(output, dict):
                loss = output.get("loss")
            if isinstance(loss, torch.Tensor):
                # A share of the step's loss (num_items_in_batch given) sums; a micro-batch's
                # mean loss averages.
                handle._summed = kwargs.get("num_items_in_batch") is not None  # type: ignore[attr-defined]
                handle.log_loss(loss)
        except Exception as exc:  # noqa: BLE001 - the agent never raises into the loop
            handle._on_error(exc)
