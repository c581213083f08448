"""Per optimizer step, on the training thread: what the agent measures and hands over.

Device reductions only (gradient range, norms, the step's scalars stacked into one tensor
whose copy to the host starts here and completes on the sender thread): no host sync.
`StepSampling` is the measuring half of the live handle (`ampwatch.agent.attached`), which
owns the hooks that call it.
"""

from __future__ import annotations

from typing import Any

import torch

from ampwatch.agent import fp8
from ampwatch.agent.handle import WatchHandle
from ampwatch.agent.hooks import ActivationMaxAbs, ActivationNorm, PrecisionProbe
from ampwatch.agent.precursors import EVERY as PRECURSORS_EVERY
from ampwatch.agent.precursors import adam_precursors
from ampwatch.agent.prenorm import take_prenorm
from ampwatch.agent.records import LayerSample, StepSample, lr_group_field
from ampwatch.agent.scaler import ScalerTap, found_inf_total, keeps_power_of_two
from ampwatch.agent.shards import GRAD_NORM_SHARDED, local_sumsq, scalar, whole_scalar
from ampwatch.agent.stats import (
    Grads,
    RunningMean,
    global_grad_norm,
    gradient_range,
    named_grads,
)


class StepSampling(WatchHandle):
    """The per-step measurements of a live handle; the state is set up by its subclass."""

    _summed: bool
    _clips: list[tuple[torch.Tensor, torch.Tensor | None, int]] | None
    _early_layers: LayerSample | None
    _named_params: list[tuple[str, torch.nn.Parameter]]
    _optimizers: list[torch.optim.Optimizer]
    _scaler: torch.amp.GradScaler | None
    _send: Any
    _every: int
    _grad_norm: bool
    #: "fsdp1" / "fsdp2" when a rank holds only its shard of each gradient, else None.
    _sharded: str | None
    #: Sharded: how many ranks hold a plain gradient whole (FSDP1's disjoint shards: 1);
    #: None when plain gradients' parts cannot be counted (`shards.local_sumsq`).
    _plain_replicas: int | None
    _rank: int
    _world_size: int
    _send_steps: bool
    _loss: RunningMean
    _scaled_loss: RunningMean | None
    _closure_loss: torch.Tensor | None
    _applied: bool
    _pending: tuple[dict[str, torch.Tensor], LayerSample | None]
    _fp8: fp8.Fp8Monitor | None
    _tap: ScalerTap | None
    _act: ActivationNorm | None
    _prenorm: ActivationNorm | None
    _act_max: ActivationMaxAbs | None
    _probe: PrecisionProbe
    #: Set when reading the optimizer's state failed once: the precursors are not retried.
    _precursors_failed: bool = False

    def _take_loss(self) -> torch.Tensor | None:
        """The step's loss: what log_loss() got, else what scaler.scale() saw (both reset)."""
        scaled = None if self._scaled_loss is None else self._scaled_loss.take(summed=self._summed)
        logged = self._loss.take(summed=self._summed)
        return scaled if logged is None else logged

    # --- per step, on the training thread ------------------------------------------------

    def _layer_sample(
        self, step: int, grads: Grads, scale: torch.Tensor | None
    ) -> LayerSample | None:
        """Range statistics (and activation max-abs) on sampled steps; a failure costs the
        sample, not the step."""
        if (step - 1) % self._every != 0:
            return None
        try:
            activations = None
            if self._act_max is not None and (peaks := self._act_max.take()) is not None:
                activations = (peaks[0], *to_host(peaks[1]))
            names, tensors, _ = grads
            if not tensors:
                return None
            device = tensors[0].device
            scale = None if scale is None else scalar(scale)
            if scale is None:
                scale = torch.ones((), dtype=torch.float32, device=device)
            direct = (
                self._tap is not None
                and self._scaler is not None
                and (self._tap.scale_left_powers_of_two or not keeps_power_of_two(self._scaler))
            )
            values, ready = to_host(gradient_range(tensors, scale, direct=direct))
            numels = [t.numel() for t in tensors]
            return LayerSample(step, self._rank, names, numels, values, ready, direct, activations)
        except Exception as exc:  # noqa: BLE001 - reported, never raised into training
            self._on_error(exc)
            return None

    def _before_clip(self, params: list[torch.Tensor]) -> None:
        """On a sampled step, measure the gradients' range before the loop clips them: a
        clip by an Inf/NaN norm zeroes (or NaNs) every gradient of an overflowing step."""
        try:
            step = self._step + 1
            if self._clips is None or self._early_layers is not None or (step - 1) % self._every:
                return
            grads = named_grads(self._named_params)
            if sum(1 for p in params if p.grad is not None) != grads.present:
                return
            scale = None if self._scaler is None else self._scaler._get_scale_async()
            self._early_layers = self._layer_sample(step, grads, scale)
        except Exception as exc:  # noqa: BLE001 - reported, never raised into training
            self._on_error(exc)

    def _take_layers(
        self, step: int, grads: Grads, scale: torch.Tensor | None
    ) -> LayerSample | None:
        early, self._early_layers = self._early_layers, None
        return early if early is not None else self._layer_sample(step, grads, scale)

    def _on_clip(
        self,
        params: list[torch.Tensor],
        total: torch.Tensor,
        after: torch.Tensor | None,
        norm_type: Any,
    ) -> None:
        try:
            if self._clips is None:
                return
            if isinstance(norm_type, (int, float)) and float(norm_type) == 2.0:
                covered = sum(1 for p in params if p.grad is not None)
                local = whole_scalar(total)  # FSDP2: a Replicate DTensor
                if local is None:
                    self._clips = None  # a norm this rank cannot read without a collective
                    return
                clipped = None if after is None else whole_scalar(after)
                self._clips.append((local, clipped, covered))
            else:
                self._clips = None  # another norm: measure the L2 norm ourselves
        except Exception as exc:  # noqa: BLE001 - reported, never raised into training
            self._on_error(exc)

    def _norms(self, grads: Grads) -> dict[str, torch.Tensor]:
        """The step's unscaled L2 grad norm: the one the loop's clip returned (before
        clipping) when one clip covered every gradient, with the norm after that clip as
        `grad_norm_clipped`; else one pass of our own (and no clipped norm), unless the
        gradients are sharded: a rank's own pass is not the global norm, so it gives its
        part, `grad_sumsq`, which the collector adds up over the ranks (`shards`)."""
        clips, self._clips = self._clips, []
        if not self._grad_norm or not grads.present:
            return {}
        if clips is not None and len(clips) == 1 and clips[0][2] == grads.present:
            total, after, _ = clips[0]
            norms = {"grad_norm": total}
            if after is not None:
                norms["grad_norm_clipped"] = after
            return norms
        if self._sharded is not None:
            device = self._named_params[0][1].device
            params = (p for _, p in self._named_params)
            sumsq = local_sumsq(params, device, plain=self._plain_replicas)
            if sumsq is None:
                self._finding("grad_norm_sharded", GRAD_NORM_SHARDED, sharding=self._sharded)
                return {}
            return {"grad_sumsq": sumsq}
        if not grads.tensors:
            return {}
        return {"grad_norm": global_grad_norm(grads.tensors)}

    def _finding(self, code: str, message: str, **details: Any) -> None:
        """Report a finding once per run (the live handle sends it)."""

    def _step_sample(self, step: int, scalars: dict[str, torch.Tensor]) -> StepSample:
        if (loss := self._take_loss()) is not None:
            scalars["loss"] = loss
        if self._act is not None and (act := self._act.take()) is not None:
            scalars["act_norm_mean"], scalars["act_norm_max"] = act
        take_prenorm(self._prenorm, scalars)
        self._take_precursors(scalars)
        host: dict[str, float | None] = {}
        # `lr` is the first optimizer's first group; `lr_groups` every group of every
        # optimizer, in order, when there is more than one (run_start lists them all).
        lrs: list[Any] = [g.get("lr") for o in self._optimizers for g in o.param_groups]
        if lrs:
            _add_lr(scalars, host, "lr", lrs[0])
        groups = 0
        if len(lrs) > 1 and all(isinstance(lr, (torch.Tensor, float, int)) for lr in lrs):
            groups = len(lrs)
            for i, lr in enumerate(lrs):
                _add_lr(scalars, host, lr_group_field(i), lr)
        return self._stacked(step, scalars, host, groups)

    def _take_precursors(self, scalars: dict[str, torch.Tensor]) -> None:
        """Adam's second-moment lag and update size, every `precursors.EVERY` steps and on
        the layer-statistics steps; an optimizer state the agent cannot read costs these two
        fields, said once, never the step."""
        sampled = self._step % self._every == 0  # this step's layer statistics too
        if self._precursors_failed or not (sampled or self._step % PRECURSORS_EVERY == 0):
            return
        try:
            scalars.update(adam_precursors(self._optimizers, update_ratio=sampled))
        except Exception as exc:  # noqa: BLE001 - reported, never raised into training
            self._precursors_failed = True
            self._on_error(exc)

    def _part_sample(self, step: int, scalars: dict[str, torch.Tensor]) -> StepSample | None:
        """A rank that sends no step scalars still sends its part of a sharded grad norm
        (with its skip flag): the collector needs the parts of every rank."""
        if "grad_sumsq" not in scalars:
            return None
        return self._stacked(step, scalars, {}, 0)

    def _stacked(
        self, step: int, scalars: dict[str, torch.Tensor], host: dict[str, float | None],
        groups: int,
    ) -> StepSample:  # fmt: skip
        """The step's device values as one stacked tensor whose host copy starts here."""
        if "grad_sumsq" in scalars:
            host["grad_parts"] = float(self._world_size)  # parts the collector waits for
        # One-element plain 0-d tensors only: a DTensor's local value, a (1,)-shaped flag.
        scalars = {k: s for k, v in scalars.items() if (s := scalar(v)) is not None}
        values: torch.Tensor | None = None
        ready = None
        if scalars:
            device = next(iter(scalars.values())).device
            values, ready = to_host(
                torch.stack(
                    [t.to(device, torch.float32, non_blocking=True) for t in scalars.values()]
                )
            )
        return StepSample(step, self._rank, tuple(scalars), values, ready, host, groups)

    def _before_update(self) -> tuple[StepSample | None, LayerSample | None] | None:
        """Scaler path, just before the real `update()`: the scale in effect for this step,
        its found-inf flags, and grads already unscaled by `step()` (fused optimizers
        unscale inside their kernel; on a skipped fused step the grads stay scaled)."""
        assert self._scaler is not None
        scale = self._scaler._get_scale_async()
        if scale is None:
            return None  # update() before any scale(): the real update() raises
        found_inf = found_inf_total(self._scaler, scale.device)
        if found_inf is None:
            return None
        step = self._step + 1
        grads = named_grads(self._named_params)
        layers = self._take_layers(step, grads, scale)
        sample = None
        if self._send_steps:
            scalars = {"loss_scale": scale, "found_inf": found_inf, **self._norms(grads)}
            sample = self._step_sample(step, scalars)
        elif self._sharded is not None:
            sample = self._part_sample(step, {"found_inf": found_inf, **self._norms(grads)})
        else:
            self._forget_clips()
        return sample, layers

    def _forget_clips(self) -> None:
        """A rank that sends no norm still sees the loop's clips: drop the step's, or the
        list would hold a device tensor per step for the whole run."""
        if self._clips is not None:
            self._clips = []

    def _emit(self, prepared: tuple[StepSample | None, LayerSample | None]) -> None:
        sample, layers = prepared
        self._step += 1
        self._probe.finish()  # the first step's forwards have run
        if self._act_max is not None and self._step % self._every == 0:
            self._act_max.arm()  # the next step is sampled: hook its forwards
        if sample is not None:
            self._send(sample)
        if layers is not None:
            self._send(layers)
        if self._fp8 is not None and (fp8_sample := self._fp8.after_step(self._step)):
            self._send(fp8_sample)

    def _optimizer_pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        """No-scaler path: grads as the optimizer will see them (scaled, if the loop scales).

        `step(closure)` (Lightning always; LBFGS) computes the step's gradients inside the
        closure, after this hook: the closure is then wrapped so that they are measured
        when it returns (each call, for LBFGS's several), and its returned loss is the
        step's loss unless log_loss() gave one.
        """
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._measure_pre_step()
            return None

        def measured_closure() -> Any:
            result = closure()
            try:
                self._closure_loss = result if isinstance(result, torch.Tensor) else None
            except Exception as exc:  # noqa: BLE001 - reported, never raised into training
                self._on_error(exc)
            self._measure_pre_step()
            return result

        self._pending = ({}, None)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": measured_closure}
        return (args[0], measured_closure, *args[2:]), kwargs

    def _measure_pre_step(self) -> None:
        try:
            grads = named_grads(self._named_params)
            sends = self._send_steps or self._sharded is not None  # or a grad_sumsq part
            norms = self._norms(grads) if sends else {}
            if not sends:
                self._forget_clips()
            self._applied = bool(grads.present)
            self._pending = (norms, self._take_layers(self._step + 1, grads, None))
        except Exception as exc:  # noqa: BLE001 - reported, never raised into training
            self._on_error(exc)

    def _optimizer_post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            norms, layers = self._pending
            self._pending = ({}, None)
            closure_loss, self._closure_loss = self._closure_loss, None
            if closure_loss is not None and not self._loss.count:
                loss = closure_loss.detach()
                self._loss.add(loss.float().mean() if loss.dim() else loss)
            sample = None
            if self._send_steps:
                sample = self._step_sample(self._step + 1, dict(norms))
            else:
                sample = self._part_sample(self._step + 1, dict(norms))
            if sample is not None:
                # Without a scaler every step is applied, unless no parameter had a
                # gradient (a skipped backward): the optimizer then changes nothing.
                sample.host["found_inf"] = 0.0 if self._applied else 1.0
            self._emit((sample, layers))
        except Exception as exc:  # noqa: BLE001 - reported, never raised into training
            self._on_error(exc)


def _add_lr(
    scalars: dict[str, torch.Tensor], host: dict[str, float | None], name: str, lr: Any
) -> None:
    """A tensor lr (capturable optimizers) rides the step's device copy: float() on it would
    be a host sync; a Python number is already on the host."""
    if isinstance(lr, torch.Tensor):
        scalars[name] = lr.detach()
    elif lr is not None:
        host[name] = float(lr)


def to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start the device-to-host copy; on CUDA, an event the sender waits on (not us)."""
    if values.device.type != "cuda":
        return values.to("cpu"), None
    host = values.to("cpu", non_blocking=True)
    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ready.record()
    return host, ready
