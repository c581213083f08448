"""Lightning: `Trainer(callbacks=[AmpwatchCallback(run="gpt-small")])`.

What Lightning does, and what the callback relies on (lightning 2.6, read from its source):

- Automatic optimization calls `optimizer.step(closure=...)` and runs `training_step`,
  `zero_grad` and backward inside the closure; without a scaler (`32-true`, `bf16-mixed`,
  and `16-mixed` on the CPU, which Lightning turns into bf16) the agent's step pre-hook
  wraps the closure and reads the gradients when it returns. With a GradScaler
  (`16-mixed` on a GPU, or a `MixedPrecision` plugin given one) the precision plugin runs
  the closure, `unscale_`, clipping, `scaler.step` and `scaler.update()`: the scaler tap
  records the step, exactly as in a plain torch.amp loop.
- With `accumulate_grad_batches=k` the non-final micro-batches call the closure directly
  and the loss each backward sees is `training_step`'s loss / k; `on_before_backward` gets
  that loss (multiplied by the scale, with a scaler), and the callback logs it, the scale
  divided back out, times k: the stored loss is the mean of what
  `training_step` returned over the step's micro-batches (k = 1 in manual optimization,
  where Lightning divides nothing).
- Gradient clipping (`gradient_clip_val`) calls `torch.nn.utils.clip_grad_norm_`, looked up
  at call time, so the agent stores the norm it returned, before clipping;
  `gradient_clip_algorithm="value"` calls `clip_grad_value_`, whose wrapper measures the
  norm before and after the clip (`ampwatch.agent.clipping`).
- `trainer.global_step` counts optimizer steps, skipped ones included, as the agent does;
  a resumed fit continues from it (`start_step`). With a scaler, a `training_step` that
  returns None makes the precision plugin skip `scaler.step` and `scaler.update()`, so
  the scaler tap sees no step while `global_step` advances: the callback records that
  step itself at `on_train_batch_end`, skipped, with the scale (unchanged) and the lr
  `on_before_optimizer_step` saw, so the numbering stays Lightning's. Several optimizers need manual
  optimization in Lightning 2: the first optimizer's step (`configure_optimizers` order)
  is the training step, with the gradients present when it steps, `lr` its first group's
  (`lr_groups` every group of every optimizer), and as loss the first backward of each
  batch (a GAN's discriminator loss, for a discriminator stepped first): the later
  backwards belong to the other optimizers' steps. Lightning's `global_step` counts every
  optimizer's steps there (2 per batch for two), so a resumed multi-optimizer fit does
  not continue the numbering exactly. With a scaler, Lightning's precision plugin calls
  `scaler.update()` after each optimizer's step, so each is a record there.
- DDP: every rank's callback attaches (the run id is rank 0's, broadcast once), rank 0
  sends the step scalars, every rank its layer statistics.

Data position (`handle.data_position`): each step's first `batch_idx` and
`trainer.current_epoch`, so a resume plan lists the batches to skip. Lightning's `batch_idx`
is the data's own when the fit starts at an epoch's start or the dataloader is resumable
(the `state_dict` / `load_state_dict` interface Lightning saves in the checkpoint); a
mid-epoch resume of another loader restarts its data while `batch_idx` continues (Lightning
warns). The relaunch: `trainer.fit(model, loader, ckpt_path=plan.path)` with
`AmpwatchCallback(resume_from=plan)`, and `training_step` returning None for
`plan.skips(batch_idx, self.current_epoch)` (Lightning then skips that batch).

The run ends `finished` at `on_train_end`, `failed` (with the exception) at
`on_exception`; `teardown` detaches whatever is still attached.

Alert to action (`watch(on_critical="stop")`, `ampwatch.agent.policy`): every checkpoint
the trainer saves (`trainer.save_checkpoint`, which `ModelCheckpoint` calls) is reported to
the advisor; when the collector reports a critical alert, the callback saves one more
through `trainer.save_checkpoint` (in `ModelCheckpoint`'s folder, else the root dir) at
the end of the batch and sets `trainer.should_stop`; `callback.exit_code` is then
`EXIT_CRITICAL_ALERT` for `sys.exit`. Lightning does not agree on `should_stop` across
ranks by itself (a rank that stops alone hangs the others): under DDP the callbacks agree
at the end of every `AGREE_EVERY`-th step through `trainer.strategy.reduce_boolean_decision`
(any rank's stop stops all, as EarlyStopping agrees), so every rank saves (rank 0 writes,
and reports it) and stops at the same step.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ampwatch.agent import EXIT_CRITICAL_ALERT, WatchHandle, watch
from ampwatch.agent.patch import patch_method
from ampwatch.agent.policy import AGREE_EVERY

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:  # the standalone package has the same API
    from pytorch_lightning import (
        Callback,
        LightningModule,
        Trainer,
    )

__all__ = ["AmpwatchCallback"]


class AmpwatchCallback(Callback):
    """Watch a Lightning fit. Keyword arguments are `ampwatch.agent.watch()`'s.

    >>> trainer = Trainer(callbacks=[AmpwatchCallback(run="gpt-small")])  # doctest: +SKIP
    """

    def __init__(self, **watch_kwargs: Any) -> None:
        for owned in ("start_step", "loss_reduction", "scaler", "optimizer"):
            if owned in watch_kwargs:
                raise TypeError(f"AmpwatchCallback sets {owned} itself from the Trainer")
        self._watch_kwargs = watch_kwargs
        self._loss_factor = 1
        #: Several optimizers: only each batch's first backward loss is the step's.
        self._first_loss_only = False
        self._loss_taken = False
        #: The lr `on_before_optimizer_step` saw (automatic optimization with a scaler).
        self._lr: Any = None
        self._scaler: torch.amp.GradScaler | None = None
        self.handle: WatchHandle | None = None
        #: The handle's exit code at detach (`ampwatch.agent.EXIT_CRITICAL_ALERT` once a
        #: critical alert stopped the fit): `sys.exit(callback.exit_code)` after `fit()`.
        self.exit_code = 0
        #: The fit stopped for a critical alert (this rank's, or another's under DDP).
        self.stopped = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.handle is not None:
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        automatic = pl_module.automatic_optimization
        self._loss_factor = trainer.accumulate_grad_batches if automatic else 1
        self._first_loss_only = not automatic and len(trainer.optimizers) > 1
        if not isinstance(scaler, torch.amp.GradScaler) or not scaler.is_enabled():
            scaler = None
        self._scaler = scaler
        self.handle = watch(
            pl_module,
            list(trainer.optimizers),
            scaler,
            start_step=trainer.global_step,
            **self._watch_kwargs,
        )
        self.handle._detach_actions.append(self._report_saves(trainer, self.handle))

    @staticmethod
    def _report_saves(trainer: Trainer, handle: WatchHandle) -> Any:
        """Report every checkpoint the trainer saves (the advisor ranks them); returns
        the function that restores `save_checkpoint`."""

        def make(original: Any) -> Any:
            def save_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> Any:
                result = original(filepath, *args, **kwargs)
                if trainer.is_global_zero:  # every rank calls it, rank 0 writes the file
                    handle.checkpoint(filepath, trainer.global_step)
                return result

            return save_checkpoint

        return patch_method(trainer, "save_checkpoint", make)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._loss_taken = False
        if self.handle is not None:  # a resume plan then lists batches, not only steps
            self.handle.data_position(batch_idx, epoch=trainer.current_epoch)

    def on_before_backward(
        self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor
    ) -> None:
        if self.handle is None or (self._first_loss_only and self._loss_taken):
            return
        self._loss_taken = True
        try:
            value = loss.detach()
            scale = None if self._scaler is None else self._scaler._get_scale_async()
            if scale is not None:
                # Lightning's MixedPrecision scales before this hook: divide the scale back
                # out (a device tensor; a power of two divides exactly).
                value = value.float() / scale
            self.handle.log_loss(value * self._loss_factor if self._loss_factor != 1 else value)
        except Exception as exc:  # noqa: BLE001 - the agent never raises into the loop
            self.handle._on_error(exc)

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.handle is not None and self._scaler is not None:
            self._lr = optimizer.param_groups[0].get("lr")  # before the scheduler steps

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        handle, scaler = self.handle, self._scaler
        if self._should_stop(trainer) and not trainer.should_stop:
            folder = (
                getattr(trainer.checkpoint_callback, "dirpath", None) or trainer.default_root_dir
            )
            name = f"ampwatch-critical-step={trainer.global_step}.ckpt"
            trainer.save_checkpoint(os.path.join(folder, name))  # reported to the advisor
            trainer.should_stop = self.stopped = True
        if handle is None or scaler is None or not pl_module.automatic_optimization:
            return
        try:
            if trainer.global_step > handle.step:  # the plugin skipped scaler.update()
                scale = scaler._get_scale_async()
                handle.record(step=trainer.global_step, skipped=True, loss_scale=scale, lr=self._lr)
        except Exception as exc:  # noqa: BLE001 - the agent never raises into the loop
            handle._on_error(exc)

    def _should_stop(self, trainer: Trainer) -> bool:
        """This rank's stop decision. Under DDP with `on_critical="stop"`: every rank's
        decision reduced with any(), every `AGREE_EVERY` steps (the schedule and the
        policy are the same on every rank, so every rank enters the collective at the
        same step, whether or not its handle heard the alert), never between."""
        local = self.handle is not None and self.handle.should_stop
        if trainer.world_size == 1 or self._watch_kwargs.get("on_critical") != "stop":
            return local
        if trainer.global_step % AGREE_EVERY != 0:
            return False
        return bool(trainer.strategy.reduce_boolean_decision(local, all=False))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._detach("finished")

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._detach("failed", repr(exception))

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._detach("finished")

    def _detach(self, status: str, reason: str | None = None) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            self.exit_code = handle.exit_code
            handle.detach(status, reason)
        if self.stopped:  # another rank heard it: this rank stopped for it too
            self.exit_code = EXIT_CRITICAL_ALERT
