"""`watch()`: attach the agent to a model, its optimizers and (optional) GradScaler.

Per optimizer step the training thread launches a few device reductions, stacks the step's
scalars into one tensor, starts its copy to the host and hands it to the sender thread; it
never waits for the device and never sees an exception from the agent.
"""

from __future__ import annotations

import atexit
import enum
import logging
import os
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ampwatch.agent import clipping, config, fp8, wire
from ampwatch.agent.hooks import (
    ActivationMaxAbs,
    ActivationNorm,
    PrecisionProbe,
    find_final_layer,
)
from ampwatch.agent.manual import manual_sample
from ampwatch.agent.records import LayerSample, StepSample, lr_group_field
from ampwatch.agent.scaler import ScalerTap, found_inf_total, keeps_power_of_two, scaler_config
from ampwatch.agent.stats import RunningMean, global_grad_norm, gradient_range, named_grads
from ampwatch.agent.summary import (
    BF16,
    FP8,
    FP16,
    guess_precision,
    model_summary,
    optimizer_summary,
    params_of_dtype,
    process_info,
    sends_steps,
)
from ampwatch.agent.transport import Sender, Transport, http_transport
from ampwatch.agent.unwrap import (
    SUPPORTED_OPTIMIZERS,
    unwrap_model,
    unwrap_optimizer,
    wrapped_scaler,
)

if TYPE_CHECKING:  # typing.Self is Python 3.11+
    from typing_extensions import Self

logger = logging.getLogger("ampwatch.agent")

#: Objects some live handle is attached to; a second `watch()` on one of them is an error.
_attached: weakref.WeakSet[object] = weakref.WeakSet()


class Lifecycle(enum.Enum):
    ATTACHED = "attached"
    DETACHED = "detached"
    DISABLED = "disabled"


class WatchHandle:
    """What `watch()` returns. Like torch's `RemovableHandle`: `detach()` is idempotent and
    removes everything the agent attached; the handle is also a context manager. A disabled
    handle accepts every call and records nothing."""

    def __init__(self, *, client_run_id: str, state: Lifecycle) -> None:
        self.client_run_id = client_run_id
        self._state = state
        self._step = 0
        self._errors = 0
        self._detach_actions: list[Callable[[], None]] = []
        self._sender: Sender | None = None

    @property
    def state(self) -> Lifecycle:
        return self._state

    @property
    def step(self) -> int:
        """Optimizer steps seen so far, skipped ones included (with a scaler: its updates)."""
        return self._step

    @property
    def counters(self) -> dict[str, int]:
        """Delivery and health counters: batches_sent, send_failures, dropped_steps, ..."""
        counters = self._sender.counters() if self._sender is not None else Sender.idle_counters()
        return {**counters, "hook_errors": self._errors}

    def log_loss(self, loss: torch.Tensor | float) -> None:
        """Report the loss of a micro-batch (a tensor: no host sync; or a number).

        The step's loss is the mean of the micro-batch losses logged since the previous
        step (their sum with `watch(..., loss_reduction="sum")`). Logged losses win over
        what `scaler.scale()` saw: an integration logs the undivided loss there.
        """

    def record(
        self,
        *,
        step: int | None = None,
        loss: float | torch.Tensor | None = None,
        loss_scale: float | torch.Tensor | None = None,
        skipped: bool | torch.Tensor | None = None,
        grad_norm: float | torch.Tensor | None = None,
        lr: float | torch.Tensor | None = None,
    ) -> None:
        """Record one optimizer step by hand (see `ampwatch.agent.manual`); never raises."""

    def checkpoint(self, path: str | os.PathLike[str], step: int | None = None) -> None:
        """Record that a checkpoint was saved at `step` (default: the current step)."""
        self._event("checkpoint", self._step if step is None else step, {"path": os.fspath(path)})

    def save_checkpoint(
        self, obj: object, path: str | os.PathLike[str], step: int | None = None
    ) -> None:
        """`torch.save(obj, path)`, then `checkpoint(path, step)`. A failed save raises as
        torch.save does and records nothing; a disabled agent still saves."""
        torch.save(obj, path)
        self.checkpoint(path, step)

    def detach(
        self, status: str = "finished", reason: str | None = None, *, timeout: float = 5.0
    ) -> None:
        """Remove every hook and patch, send `run_end`, flush for at most `timeout` seconds.

        Idempotent: later calls do nothing.
        """
        if self._state is not Lifecycle.ATTACHED:
            return
        for action in reversed(self._detach_actions):
            action()
        self._detach_actions.clear()
        self._event("run_end", self._step, {"status": status, "reason": reason})
        self._state = Lifecycle.DETACHED
        if self._sender is not None:
            self._sender.close(timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.detach("finished")
        else:
            self.detach("failed", reason=repr(exc))

    def _event(self, kind: str, step: int | None, data: dict[str, Any]) -> None:
        if self._state is Lifecycle.ATTACHED and self._sender is not None:
            self._sender.put({"kind": kind, "step": step, "time": time.time(), "data": data})

    def _on_error(self, exc: BaseException) -> None:
        """Hook bodies report here: log the first failure with its traceback, count all."""
        if self._errors == 0:
            logger.warning("ampwatch agent hook failed; training continues", exc_info=exc)
        self._errors += 1


class _AttachedHandle(WatchHandle):
    """The live handle: owns the hooks, the scaler tap, the clip check and the sender."""

    def __init__(
        self,
        model: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        scaler: torch.amp.GradScaler | None,
        *,
        sender: Sender,
        settings: config.Config,
        measure_grad_norm: bool,
        final_layer: tuple[str, nn.Module, bool] | None,
        client_run_id: str,
        rank: int,
        send_steps: bool,
        activation_max_abs: bool,
        loss_reduction: str,
        start_step: int,
    ) -> None:
        super().__init__(client_run_id=client_run_id, state=Lifecycle.ATTACHED)
        self._step = start_step
        self._summed = loss_reduction == "sum"
        #: Norms the loop's own clip_grad_norm_ returned since the last step, each with the
        #: norm after that clip and the number of gradients it covered; None once a clip
        #: ran on still-scaled grads.
        self._clips: list[tuple[torch.Tensor, torch.Tensor | None, int]] | None = []
        #: A sampled step's range statistics, taken just before the loop's clip.
        self._early_layers: LayerSample | None = None
        self._model = model
        #: Walked once: `named_parameters()` recurses through every module on each call
        #: (~65 us of a 3M-parameter model's per-step work); parameters added to the model
        #: after watch() are not measured.
        self._named_params = list(model.named_parameters())
        self._optimizers = optimizers
        self._scaler = scaler
        self._sender = sender
        self._send = sender.put
        self._every = settings.layer_stats_every
        self._grad_norm = measure_grad_norm
        self._rank = rank
        self._send_steps = send_steps
        self._loss = RunningMean()  # log_loss()
        self._scaled_loss: RunningMean | None = None  # what scaler.scale() saw
        self._closure_loss: torch.Tensor | None = None  # what step(closure)'s closure returned
        self._applied = True  # no-scaler path: whether the step had any gradient
        #: No-scaler path: the step's norms and layer sample, measured before step().
        self._pending: tuple[dict[str, torch.Tensor], LayerSample | None] = ({}, None)
        self._reported: set[str] = set()
        self._fp8: fp8.Fp8Monitor | None = None  # set by watch()
        self._tap: ScalerTap | None = None
        self._act: ActivationNorm | None = None
        if final_layer is not None:
            self._act = ActivationNorm(self._on_error)
            self._add_hook(self._act.attach(final_layer[1], final_layer[2]))
        self._act_max: ActivationMaxAbs | None = None
        if activation_max_abs and optimizers:  # sent with layer statistics: automatic mode
            self._act_max = ActivationMaxAbs(model, self._on_error)
            self._act_max.arm()  # step 1 is sampled
            self._detach_actions.append(self._act_max.disarm)
        device = next((p.device.type for p in model.parameters()), "cpu")
        self._probe = PrecisionProbe(device, self._on_precision, self._on_error)
        self._probe.attach(model)
        self._detach_actions.append(self._probe.finish)
        if optimizers:
            self._detach_actions.append(clipping.observe(self._on_clip))
        if scaler is not None:
            self._tap = ScalerTap(
                scaler,
                before_update=self._before_update,
                after_update=self._emit,
                on_error=self._on_error,
            )
            self._tap.attach()
            self._scaled_loss = self._tap.loss
            self._detach_actions.append(self._tap.detach)
            check = clipping.ScaledClipCheck(
                scaler, optimizers, self._on_scaled_clip, self._on_error
            )
            self._detach_actions.append(clipping.register(check))
        elif optimizers:
            # Several optimizers without a scaler: the first one's step is the training step.
            first = optimizers[0]
            self._add_hook(first.register_step_pre_hook(self._optimizer_pre_step))
            self._add_hook(first.register_step_post_hook(self._optimizer_post_step))
        if optimizers:  # after ScaledClipCheck: it runs first and flags still-scaled grads
            self._detach_actions.append(clipping.register(self._before_clip))
        self._watched = [o for o in (model, *optimizers, scaler) if o is not None]
        _attached.update(self._watched)
        atexit.register(self._at_exit)
        self._detach_actions.insert(0, self._release)

    def log_loss(self, loss: torch.Tensor | float) -> None:
        if self._state is not Lifecycle.ATTACHED:
            return
        try:
            if isinstance(loss, torch.Tensor):
                value = loss.detach()
                self._loss.add(value.float().mean() if value.dim() else value)
            else:
                self._loss.add(torch.tensor(float(loss)))
        except Exception as exc:  # noqa: BLE001 - the agent never raises into the training loop
            self._on_error(exc)

    def _take_loss(self) -> torch.Tensor | None:
        """The step's loss: what log_loss() got, else what scaler.scale() saw (both reset)."""
        scaled = None if self._scaled_loss is None else self._scaled_loss.take(summed=self._summed)
        logged = self._loss.take(summed=self._summed)
        return scaled if logged is None else logged

    def record(
        self,
        *,
        step: int | None = None,
        loss: float | torch.Tensor | None = None,
        loss_scale: float | torch.Tensor | None = None,
        skipped: bool | torch.Tensor | None = None,
        grad_norm: float | torch.Tensor | None = None,
        lr: float | torch.Tensor | None = None,
    ) -> None:
        if self._state is not Lifecycle.ATTACHED:
            return
        try:
            number = self._step + 1 if step is None else int(step)
            logged = self._take_loss()  # log_loss() calls since the last step
            values: dict[str, object] = {
                "loss": logged if loss is None else loss,
                "loss_scale": loss_scale,
                "found_inf": skipped,
                "grad_norm": grad_norm,
                "lr": lr,
            }
            if self._act is not None and (act := self._act.take()) is not None:
                values["act_norm_mean"], values["act_norm_max"] = act
            sample = manual_sample(number, self._rank, values, _to_host)
            self._step = number
            if self._send_steps:
                self._send(sample)
        except Exception as exc:  # noqa: BLE001 - the agent never raises into the training loop
            self._on_error(exc)

    def _release(self) -> None:
        atexit.unregister(self._at_exit)
        for obj in self._watched:
            _attached.discard(obj)

    def _add_hook(self, handle: RemovableHandle) -> None:
        self._detach_actions.append(handle.remove)

    def _at_exit(self) -> None:
        self.detach("exited", reason="the process exited without detach()")

    def _finding(self, code: str, message: str, **details: Any) -> None:
        """Send a finding once per run: a recurring misuse is one finding, not one per step."""
        if code not in self._reported:
            self._reported.add(code)
            step = self._step if self._step else None
            self._event("finding", step, {"code": code, "message": message, **details})

    def _on_precision(self, kind: str, detail: dict[str, Any]) -> None:
        if kind == "fp8_modules":
            self._finding("fp8_in_use", "FP8 modules run under FP8 autocast", **detail)
            return
        dtype = detail["dtype"]
        if dtype == torch.bfloat16:
            self._finding(
                "bf16_in_use", "bfloat16 autocast is on", source="autocast", **_str(detail)
            )
        elif dtype == torch.float16 and self._scaler is None and self._optimizers:
            self._finding(
                "fp16_params_without_scaler",
                "float16 autocast is on and no enabled GradScaler is watched: small "
                "gradients will underflow to zero",
                source="autocast",
                **_str(detail),
            )

    def _on_scaled_clip(self, optimizers: list[str]) -> None:
        self._clips = None  # the norm it returns is still multiplied by the scale
        self._finding(
            "clip_before_unscale",
            "clip_grad_norm_ ran on gradients still multiplied by the loss scale: call "
            "scaler.unscale_(optimizer) before clipping",
            optimizers=optimizers,
            at_step=self._step + 1,
        )

    # --- per step, on the training thread ------------------------------------------------

    def _layer_sample(
        self, step: int, grads: tuple[list[str], list[torch.Tensor]], scale: torch.Tensor | None
    ) -> LayerSample | None:
        """Range statistics (and activation max-abs) on sampled steps; a failure costs the
        sample, not the step."""
        if (step - 1) % self._every != 0:
            return None
        try:
            activations = None
            if self._act_max is not None and (peaks := self._act_max.take()) is not None:
                activations = (peaks[0], *_to_host(peaks[1]))
            names, tensors = grads
            if not tensors:
                return None
            device = tensors[0].device
            if scale is None:
                scale = torch.ones((), dtype=torch.float32, device=device)
            direct = (
                self._tap is not None
                and self._scaler is not None
                and (self._tap.scale_left_powers_of_two or not keeps_power_of_two(self._scaler))
            )
            values, ready = _to_host(gradient_range(tensors, scale, direct=direct))
            numels = [t.numel() for t in tensors]
            return LayerSample(step, self._rank, names, numels, values, ready, direct, activations)
        except Exception as exc:  # noqa: BLE001 - the agent never raises into the training loop
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
            if sum(1 for p in params if p.grad is not None) != len(grads[1]):
                return
            scale = None if self._scaler is None else self._scaler._get_scale_async()
            self._early_layers = self._layer_sample(step, grads, scale)
        except Exception as exc:  # noqa: BLE001 - the agent never raises into the training loop
            self._on_error(exc)

    def _take_layers(
        self, step: int, grads: tuple[list[str], list[torch.Tensor]], scale: torch.Tensor | None
    ) -> LayerSample | None:
        early, self._early_layers = self._early_layers, None
        return early if early is not None else self._layer_sample(step, grads, scale)

    def _on_clip(
        self, params: list[torch.Tensor], total: torch.Tensor, max_norm: Any, norm_type: Any
    ) -> None:
        try:
            if self._clips is None:
                return
            if isinstance(norm_type, (int, float)) and float(norm_type) == 2.0:
                covered = sum(1 for p in params if p.grad is not None)
                total = total.detach()
                after = None
                if isinstance(max_norm, (int, float, torch.Tensor)):
                    after = clipping.clipped_norm(total, max_norm)
                self._clips.append((total, after, covered))
            else:
                self._clips = None  # another norm: measure the L2 norm ourselves
        except Exception as exc:  # noqa: BLE001 - the agent never raises into the training loop
            self._on_error(exc)

    def _norms(self, grads: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The step's unscaled L2 grad norm: the one the loop's clip returned (before
        clipping) when one clip covered every gradient, with the norm after that clip as
        `grad_norm_clipped`; else one pass of our own (and no clipped norm)."""
        clips, self._clips = self._clips, []
        if not self._grad_norm or not grads:
            return {}
        if clips is not None and len(clips) == 1 and clips[0][2] == len(grads):
            total, after, _ = clips[0]
            norms = {"grad_norm": total}
            if after is not None:
                norms["grad_norm_clipped"] = after
            return norms
        return {"grad_norm": global_grad_norm(grads)}

    def _step_sample(self, step: int, scalars: dict[str, torch.Tensor]) -> StepSample:
        if (loss := self._take_loss()) is not None:
            scalars["loss"] = loss
        if self._act is not None and (act := self._act.take()) is not None:
            scalars["act_norm_mean"], scalars["act_norm_max"] = act
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
        values: torch.Tensor | None = None
        ready = None
        if scalars:
            device = next(iter(scalars.values())).device
            values, ready = _to_host(
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
            scalars = {"loss_scale": scale, "found_inf": found_inf, **self._norms(grads[1])}
            sample = self._step_sample(step, scalars)
        return sample, layers

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
            except Exception as exc:  # noqa: BLE001 - the agent never raises into the training loop
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
            norms = self._norms(grads[1]) if self._send_steps else {}
            self._applied = bool(grads[1])
            self._pending = (norms, self._take_layers(self._step + 1, grads, None))
        except Exception as exc:  # noqa: BLE001 - the agent never raises into the training loop
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
                # Without a scaler every step is applied, unless no parameter had a
                # gradient (a skipped backward): the optimizer then changes nothing.
                sample.host["found_inf"] = 0.0 if self._applied else 1.0
            self._emit((sample, layers))
        except Exception as exc:  # noqa: BLE001 - the agent never raises into the training loop
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


def _str(detail: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v).removeprefix("torch.") for k, v in detail.items()}


def _to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start the device-to-host copy; on CUDA, an event the sender waits on (not us)."""
    if values.device.type != "cuda":
        return values.to("cpu"), None
    host = values.to("cpu", non_blocking=True)
    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ready.record()
    return host, ready


def _shared_run_id(run_id: str | None, world_size: int) -> str:
    """Every rank must report under one run: the configured id, else rank 0's, broadcast
    once at attach (a collective: with torch.distributed initialized, every rank calls
    `watch()`, as every rank constructs DDP), else a fresh one."""
    if run_id is not None:
        return run_id
    fresh = uuid.uuid4().hex
    if world_size == 1:
        return fresh
    shared = [fresh]
    torch.distributed.broadcast_object_list(shared, src=0)
    return str(shared[0])


def watch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    scaler: torch.amp.GradScaler | None = None,
    *,
    run: str | None = None,
    run_id: str | None = None,
    project: str | None = None,
    url: str | None = None,
    token: str | None = None,
    offline_file: str | os.PathLike[str] | None = None,
    layer_stats_every: int | None = None,
    grad_norm: bool = True,
    final_layer: str | None = None,
    steps_from_every_rank: bool = False,
    activation_max_abs: bool = False,
    fp8_stats_every: int | None = fp8.DEFAULT_EVERY,
    fp8_activations: bool = True,
    fp8_recipe: str | None = None,
    loss_reduction: str = "mean",
    start_step: int = 0,
    accelerator: Any = None,
    flush_interval: float = 1.0,
    max_queue: int = 10_000,
    transport: Transport | None = None,
    enabled: bool = True,
) -> WatchHandle:
    """Attach to a training loop and stream its mixed-precision health to the collector.

    The standard torch.amp loop runs unchanged::

        handle = watch(model, optimizer, scaler, run="gpt-small")
        for batch in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(batch)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        handle.detach()

    One record per optimizer step: with a scaler, per `scaler.update()` (micro-batches of
    gradient accumulation are averaged into its loss); without one, per `step()` of the
    first optimizer. Several optimizers: `watch(model, [opt1, opt2], scaler)`. No optimizer:
    nothing is recorded automatically; call `handle.record(...)` (`ampwatch.agent.manual`).

    `layer_stats_every` (N, default 20, or AMPWATCH_LAYER_STATS_EVERY): gradient-range
    statistics and exponent histograms are measured at steps 1, N+1, 2N+1, ... They read
    every gradient three times (histogram, zero count, max): bench/agent_overhead.py
    measured a sampled step's work at ~4.4% of a 3M-parameter CPU step and the unsampled
    per-step work at ~0.3%, so N=20 keeps the total near 0.5% (GPU bar: 1%), while
    underflow that stops a layer learning persists for hundreds of steps.
    `grad_norm` (default on): the unscaled global L2 norm every step (one fast pass).
    `activation_max_abs` (default off): at the same sampled steps, max |output| of every
    leaf module (overflow headroom for FP16/FP8 activations), sent with the layer
    statistics (so not with `handle.record()` alone). Off by default: it adds a reduction
    per leaf module to a sampled step's forwards.
    `fp8_stats_every` (M, default 200; None: off): FP8 readiness of every nn.Linear's
    weight, gradient and (`fp8_activations`) input at steps 1, M+1, ... (`ampwatch.agent.fp8`);
    `fp8_recipe`: the FP8 recipe the run uses or plans, one of `wire.FP8_RECIPES`.

    Gradient accumulation: the step's loss is the mean of its micro-batch losses (those
    `scaler.scale()` saw, or `handle.log_loss()` got); `loss_reduction="sum"` for a loop
    that divides each micro-batch loss by the number of micro-batches before backward, so
    that the stored loss is the undivided one. `start_step`: optimizer steps already taken
    (a resumed run continues its numbering). Wrapped objects are unwrapped (DDP,
    torch.compile, accelerate's AcceleratedOptimizer, Lightning's LightningOptimizer);
    `accelerator=` (an accelerate `Accelerator`): its scaler is watched, and the loss
    given to `accelerator.backward(loss)`, undivided, is the step's loss. When the loop
    clips (`clip_grad_norm_`), the norm it returned, before clipping, is the grad norm.

    `token` is sent as `Authorization: Bearer <token>`; `offline_file` writes batches to
    that file only (send it later with `ampwatch upload FILE`). Arguments win over
    AMPWATCH_* environment variables (`ampwatch.agent.config`).
    `enabled=False` or AMPWATCH_DISABLED=1 returns a handle that does nothing (no hooks, no
    thread). Distributed: rank 0 sends step scalars (all ranks with
    `steps_from_every_rank`), every rank its layer statistics, all tagged with their rank.
    Raises TypeError/ValueError on misuse, RuntimeError if an object is already watched.
    """
    settings = config.resolve(
        url=url,
        token=token,
        run=run,
        run_id=run_id,
        project=project,
        layer_stats_every=layer_stats_every,
        offline_file=None if offline_file is None else os.fspath(offline_file),
        enabled=enabled,
    )
    if not settings.enabled:
        return WatchHandle(
            client_run_id=settings.run_id or uuid.uuid4().hex, state=Lifecycle.DISABLED
        )
    optimizers = _optimizer_list(optimizer)
    if scaler is None:
        scaler = next((s for o in _as_list(optimizer) if (s := wrapped_scaler(o))), None)
    if accelerator is not None and scaler is None:
        scaler = getattr(accelerator, "scaler", None)
    model = unwrap_model(model)
    _check_arguments(model, optimizers, scaler, settings, flush_interval, max_queue, transport)
    fp8.check_options(fp8_stats_every, fp8_recipe)
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f'loss_reduction must be "mean" or "sum", got {loss_reduction!r}')
    if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
        raise ValueError(f"start_step must be an int >= 0, got {start_step!r}")
    if scaler is not None and not scaler.is_enabled():
        scaler = None
    for obj in (model, *optimizers, scaler):
        if obj is not None and obj in _attached:
            raise RuntimeError(
                f"this {type(obj).__name__} is already watched; detach() the first handle "
                "before calling watch() again"
            )
    head = find_final_layer(model, final_layer)
    info = process_info()
    client_run_id = _shared_run_id(settings.run_id, info["world_size"])
    name = settings.run or f"{type(model).__name__}-{time.strftime('%Y%m%d-%H%M%S')}"
    if transport is None and settings.offline_file is None:
        transport = http_transport(settings.url)
    run_ref: wire.RunRef = {"client_run_id": client_run_id, "name": name}
    if settings.project is not None:
        run_ref["project"] = settings.project
    sender = Sender(
        run_ref,
        transport,
        token=settings.token,
        offline_file=settings.offline_file,
        flush_interval=flush_interval,
        max_queue=max_queue,
    )
    send_steps = sends_steps(info["rank"], every_rank=steps_from_every_rank)
    handle = _AttachedHandle(
        model,
        optimizers,
        scaler,
        sender=sender,
        settings=settings,
        measure_grad_norm=grad_norm,
        final_layer=head,
        client_run_id=client_run_id,
        rank=info["rank"],
        send_steps=send_steps,
        activation_max_abs=activation_max_abs,
        loss_reduction=loss_reduction,
        start_step=start_step,
    )
    if fp8_stats_every and optimizers:
        handle._fp8 = fp8.Fp8Monitor(
            model,
            every=fp8_stats_every,
            activations=fp8_activations,
            rank=info["rank"],
            on_error=handle._on_error,
            to_host=_to_host,
        )
        handle._detach_actions.append(handle._fp8.disarm)
    if accelerator is not None:
        from ampwatch.integrations.accelerate import tap_backward

        handle._detach_actions.append(tap_backward(accelerator, handle))
    sender.start()
    handle._event(
        "run_start",
        None,
        {
            "model": model_summary(model),
            "optimizers": [optimizer_summary(o) for o in optimizers],
            "scaler": scaler_config(scaler) if scaler is not None else None,
            "precision": guess_precision(model, scaler is not None),
            "final_layer": None
            if head is None
            else {"name": head[0], "measures": "input" if head[2] else "output"},
            "layer_stats_every": settings.layer_stats_every,
            "grad_norm": grad_norm,
            "activation_max_abs": activation_max_abs,
            "fp8_stats_every": fp8_stats_every,
            "fp8_recipe": fp8_recipe,
            "mode": "automatic" if optimizers else "manual",
            "step_scalars_from": "every rank" if steps_from_every_rank else "rank 0",
            **info,
        },
    )
    _attach_findings(handle, model, scaler is None and bool(optimizers))
    return handle


def _attach_findings(handle: _AttachedHandle, model: nn.Module, unscaled: bool) -> None:
    """Findings the parameters already show (autocast shows at the first forward)."""
    if unscaled and (half := params_of_dtype(model, FP16)):
        handle._finding(
            "fp16_params_without_scaler",
            f"{len(half)} parameter tensors are float16 and no enabled GradScaler "
            "is watched: small gradients will underflow to zero",
            source="parameters",
            params=half[:20],
            count=len(half),
        )
    if bf16 := params_of_dtype(model, BF16):
        handle._finding(
            "bf16_in_use",
            f"{len(bf16)} parameter tensors are bfloat16",
            source="parameters",
            params=bf16[:20],
            count=len(bf16),
        )
    if fp8 := params_of_dtype(model, FP8, buffers=True):
        handle._finding(
            "fp8_in_use",
            f"{len(fp8)} parameter or buffer tensors are stored in an FP8 dtype",
            source="parameters",
            params=fp8[:20],
            count=len(fp8),
        )


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


def _check_arguments(
    model: object,
    optimizers: list[torch.optim.Optimizer],
    scaler: object,
    settings: config.Config,
    flush_interval: float,
    max_queue: int,
    transport: object,
) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}"
        )
    if scaler is not None and not optimizers:
        raise ValueError(
            "a scaler needs the optimizer(s) it steps: watch(model, optimizer, scaler)"
        )
    for label, value in (("run", settings.run), ("project", settings.project)):
        if value is not None and not (
            isinstance(value, str) and 0 < len(value) <= wire.MAX_NAME_LENGTH
        ):
            raise ValueError(
                f"{label} must be a non-empty string of at most {wire.MAX_NAME_LENGTH} characters"
            )
    every = settings.layer_stats_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"layer_stats_every must be an int >= 1, got {every!r}")
    if not flush_interval > 0:
        raise ValueError(f"flush_interval must be > 0 seconds, got {flush_interval!r}")
    if not isinstance(max_queue, int) or max_queue < 1:
        raise ValueError(f"max_queue must be an int >= 1, got {max_queue!r}")
    if transport is not None and not callable(transport):
        raise TypeError("transport must be a callable (body: bytes, headers: dict) -> HTTP status")
