"""`watch()`: attach the agent to a model, optimizer and (optional) GradScaler.

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
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ampwatch.agent import wire
from ampwatch.agent.hooks import ActivationNorm, find_final_layer
from ampwatch.agent.records import LayerSample, StepSample
from ampwatch.agent.scaler import ScalerTap, found_inf_total, scaler_config
from ampwatch.agent.stats import RunningMean, nonzero_counts
from ampwatch.agent.summary import fp16_params, guess_precision, model_summary, process_info
from ampwatch.agent.transport import Sender, Transport, http_transport

logger = logging.getLogger("ampwatch.agent")

DEFAULT_URL = "http://127.0.0.1:8765"

#: Objects some live handle is attached to; a second `watch()` on one of them is an error.
_attached: weakref.WeakSet[object] = weakref.WeakSet()


class Lifecycle(enum.Enum):
    ATTACHED = "attached"
    DETACHED = "detached"
    DISABLED = "disabled"


class WatchHandle:
    """What `watch()` returns. Like torch's `RemovableHandle`: `detach()` is idempotent and
    removes everything the agent attached; the handle is also a context manager."""

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

    def log_loss(self, loss: torch.Tensor) -> None:
        """Report the loss of a micro-batch when no GradScaler is watched (no host sync)."""

    def checkpoint(self, path: str | os.PathLike[str], step: int | None = None) -> None:
        """Record that a checkpoint was saved at `step` (default: the current step)."""
        self._event("checkpoint", self._step if step is None else step, {"path": os.fspath(path)})

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

    def __enter__(self) -> WatchHandle:
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
    """The live handle: owns the hooks, the scaler tap and the sender."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        *,
        sender: Sender,
        layer_stats_every: int,
        final_layer: tuple[str, nn.Module, bool] | None,
        client_run_id: str,
        rank: int,
    ) -> None:
        super().__init__(client_run_id=client_run_id, state=Lifecycle.ATTACHED)
        self._model = model
        self._optimizer = optimizer
        self._scaler = scaler
        self._sender = sender
        self._send = sender.put
        self._every = layer_stats_every
        self._rank = rank
        self._loss = RunningMean()
        self._pending_layers: LayerSample | None = None
        self._act: ActivationNorm | None = None
        if final_layer is not None:
            self._act = ActivationNorm(self._on_error)
            self._add_hook(self._act.attach(final_layer[1], final_layer[2]))
        if scaler is not None:
            tap = ScalerTap(
                scaler,
                before_update=self._before_update,
                after_update=self._emit,
                on_error=self._on_error,
            )
            tap.attach()
            self._loss = tap.loss
            self._detach_actions.append(tap.detach)
        else:
            self._add_hook(optimizer.register_step_pre_hook(self._optimizer_pre_step))
            self._add_hook(optimizer.register_step_post_hook(self._optimizer_post_step))
        self._watched = [o for o in (model, optimizer, scaler) if o is not None]
        _attached.update(self._watched)
        atexit.register(self._at_exit)
        self._detach_actions.insert(0, self._release)

    def log_loss(self, loss: torch.Tensor) -> None:
        if self._state is not Lifecycle.ATTACHED or self._scaler is not None:
            return  # with a scaler the loss is read from scaler.scale(loss)
        try:
            value = loss.detach()
            self._loss.add(value.float().mean() if value.dim() else value)
        except Exception as exc:
            self._on_error(exc)

    def _release(self) -> None:
        atexit.unregister(self._at_exit)
        for obj in self._watched:
            _attached.discard(obj)

    def _add_hook(self, handle: RemovableHandle) -> None:
        self._detach_actions.append(handle.remove)

    def _at_exit(self) -> None:
        self.detach("exited", reason="the process exited without detach()")

    # --- per step, on the training thread ------------------------------------------------

    def _layer_sample(self, step: int) -> LayerSample | None:
        """Zero counts on sampled steps; a failure here costs the sample, not the step."""
        if (step - 1) % self._every != 0:
            return None
        try:
            counted = nonzero_counts(self._model.named_parameters())
            if counted is None:
                return None
            names, numels, nonzero = counted
            host, ready = _to_host(nonzero)
            return LayerSample(step, self._rank, names, numels, host, ready)
        except Exception as exc:
            self._on_error(exc)
            return None

    def _step_sample(self, step: int, scalars: dict[str, torch.Tensor]) -> StepSample:
        if (loss := self._loss.take()) is not None:
            scalars["loss"] = loss
        if self._act is not None and (act := self._act.take()) is not None:
            scalars["act_norm_mean"], scalars["act_norm_max"] = act
        lr: Any = self._optimizer.param_groups[0]["lr"]
        if isinstance(lr, torch.Tensor):  # a tensor lr (capturable optimizers)
            if lr.device.type == "cpu":
                lr = float(lr)
            else:
                scalars["lr"], lr = lr.detach(), None
        values: torch.Tensor | None = None
        ready = None
        if scalars:
            device = next(iter(scalars.values())).device
            values, ready = _to_host(
                torch.stack(
                    [t.to(device, torch.float32, non_blocking=True) for t in scalars.values()]
                )
            )
        return StepSample(step, self._rank, tuple(scalars), values, ready, lr)

    def _before_update(self) -> tuple[StepSample, LayerSample | None] | None:
        """Scaler path, just before the real `update()`: the scale in effect for this step,
        its found-inf flags, and (sampled steps) grads already unscaled by `step()`."""
        assert self._scaler is not None
        scale = self._scaler._get_scale_async()
        if scale is None:
            return None  # update() before any scale(): the real update() raises
        found_inf = found_inf_total(self._scaler, scale.device)
        if found_inf is None:
            return None
        step = self._step + 1
        layers = self._layer_sample(step)
        sample = self._step_sample(step, {"loss_scale": scale, "found_inf": found_inf})
        return sample, layers

    def _emit(self, prepared: tuple[StepSample, LayerSample | None]) -> None:
        sample, layers = prepared
        self._step = sample.step
        self._send(sample)
        if layers is not None:
            self._send(layers)

    def _optimizer_pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """No-scaler path: grads as the optimizer will see them (scaled, if the loop scales)."""
        self._pending_layers = self._layer_sample(self._step + 1)

    def _optimizer_post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            self._emit((self._step_sample(self._step + 1, {}), self._pending_layers))
            self._pending_layers = None
        except Exception as exc:
            self._on_error(exc)


def _to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start the device-to-host copy; on CUDA, an event the sender waits on (not us)."""
    if values.device.type != "cuda":
        return values.to("cpu"), None
    host = values.to("cpu", non_blocking=True)
    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ready.record()
    return host, ready


def _env_disabled() -> bool:
    return os.environ.get("AMPWATCH_DISABLED", "").strip().lower() in ("1", "true", "yes", "on")


def watch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None = None,
    *,
    run: str | None = None,
    project: str = "default",
    url: str | None = None,
    layer_stats_every: int = 20,
    final_layer: str | None = None,
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

    `layer_stats_every` (N, default 20): per-parameter zero fractions are measured at steps
    1, N+1, 2N+1, ... Counting zeros reads every gradient once (about 8 ms for 5.5M fp32
    grads on a CPU core), so N=20 keeps it near 0.5% of even a fast step, while underflow
    that stops a layer learning persists for hundreds of steps: 20 steps of resolution
    loses nothing a detector needs.

    A scaler that is not enabled counts as no scaler. `enabled=False` or the environment
    variable AMPWATCH_DISABLED=1 returns a handle that does nothing (no hooks, no thread).
    Raises TypeError/ValueError on misuse, RuntimeError if an object is already watched.
    """
    client_run_id = uuid.uuid4().hex
    if not enabled or _env_disabled():
        return WatchHandle(client_run_id=client_run_id, state=Lifecycle.DISABLED)
    _check_arguments(
        model,
        optimizer,
        scaler,
        run,
        project,
        layer_stats_every,
        flush_interval,
        max_queue,
        transport,
    )
    if scaler is not None and not scaler.is_enabled():
        scaler = None
    for obj in (model, optimizer, scaler):
        if obj is not None and obj in _attached:
            raise RuntimeError(
                f"this {type(obj).__name__} is already watched; detach() the first handle "
                "before calling watch() again"
            )
    head = find_final_layer(model, final_layer)
    info = process_info()
    name = run if run is not None else f"{type(model).__name__}-{time.strftime('%Y%m%d-%H%M%S')}"
    if transport is None:
        transport = http_transport(url or os.environ.get("AMPWATCH_URL") or DEFAULT_URL)
    run_ref: wire.RunRef = {"client_run_id": client_run_id, "name": name, "project": project}
    sender = Sender(run_ref, transport, flush_interval=flush_interval, max_queue=max_queue)
    handle = _AttachedHandle(
        model,
        optimizer,
        scaler,
        sender=sender,
        layer_stats_every=layer_stats_every,
        final_layer=head,
        client_run_id=client_run_id,
        rank=info["rank"],
    )
    sender.start()
    handle._event(
        "run_start",
        None,
        {
            "model": model_summary(model),
            "optimizer": type(optimizer).__qualname__,
            "scaler": scaler_config(scaler) if scaler is not None else None,
            "precision": guess_precision(model, scaler is not None),
            "final_layer": None
            if head is None
            else {"name": head[0], "measures": "input" if head[2] else "output"},
            "layer_stats_every": layer_stats_every,
            **info,
        },
    )
    if scaler is None and (half := fp16_params(model)):
        handle._event(
            "finding",
            None,
            {
                "code": "fp16_params_without_scaler",
                "message": f"{len(half)} parameter tensors are float16 and no enabled GradScaler "
                "is watched: small gradients will underflow to zero",
                "params": half[:20],
                "count": len(half),
            },
        )
    return handle


def _check_arguments(
    model: object,
    optimizer: object,
    scaler: object,
    run: str | None,
    project: str,
    layer_stats_every: int,
    flush_interval: float,
    max_queue: int,
    transport: object,
) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}"
        )
    for label, value in (("run", run), ("project", project)):
        if value is not None and not (
            isinstance(value, str) and 0 < len(value) <= wire.MAX_NAME_LENGTH
        ):
            raise ValueError(
                f"{label} must be a non-empty string of at most {wire.MAX_NAME_LENGTH} characters"
            )
    if (
        isinstance(layer_stats_every, bool)
        or not isinstance(layer_stats_every, int)
        or layer_stats_every < 1
    ):
        raise ValueError(f"layer_stats_every must be an int >= 1, got {layer_stats_every!r}")
    if not flush_interval > 0:
        raise ValueError(f"flush_interval must be > 0 seconds, got {flush_interval!r}")
    if not isinstance(max_queue, int) or max_queue < 1:
        raise ValueError(f"max_queue must be an int >= 1, got {max_queue!r}")
    if transport is not None and not callable(transport):
        raise TypeError("transport must be a callable (body: bytes, headers: dict) -> HTTP status")
