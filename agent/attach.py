"""`watch()`: attach the agent to a model, its optimizers and (optional) GradScaler.

Here: the order of attaching, the run's identity, and the wiring of the parts; the
arguments are unwrapped (`ampwatch.agent.unwrap`) and checked first, before anything is
hooked (`ampwatch.agent.arguments`: TypeError/ValueError saying how to fix them). The parts:
the live handle and its hooks (`ampwatch.agent.attached`), which measure each step
(`ampwatch.agent.sampling`: a few device reductions, the step's scalars stacked into one
tensor whose host copy the sender thread waits for) and hand samples to the sender
(`ampwatch.agent.transport`). The training thread never waits for the device and never sees
an exception from the agent.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ampwatch.agent import compiled, config, fp8, wire
from ampwatch.agent.arguments import Measures, check_arguments, check_delivery
from ampwatch.agent.attached import AttachedHandle, attach_findings, check_not_watched
from ampwatch.agent.delivery import DeliveryOptions
from ampwatch.agent.handle import Lifecycle, WatchHandle
from ampwatch.agent.hooks import find_final_layer
from ampwatch.agent.http_transport import Transport, http_transport
from ampwatch.agent.policy import AlertPolicy, OnCritical, check_on_critical
from ampwatch.agent.resume import ResumeFrom, load_resume_plan
from ampwatch.agent.sampling import to_host
from ampwatch.agent.scaler import scaler_config
from ampwatch.agent.shards import compute_dtype
from ampwatch.agent.summary import (
    guess_precision,
    model_summary,
    optimizer_summary,
    process_info,
    sends_steps,
)
from ampwatch.agent.transport import Sender
from ampwatch.agent.unwrap import watched_objects

#: The handle's public names live in `ampwatch.agent.handle`; `ampwatch.agent` exports them.
__all__ = ["Lifecycle", "WatchHandle", "watch"]


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
    min_loss_scale: float | None = None,
    accelerator: Any = None,
    flush_interval: float = 1.0,
    max_queue: int = 10_000,
    transport: Transport | None = None,
    delivery: DeliveryOptions | None = None,
    on_critical: OnCritical = "warn",
    resume_from: ResumeFrom | dict[str, Any] | str | os.PathLike[str] | None = None,
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
    `fp8_stats_every` (M, default 500; None: off): FP8 readiness of every nn.Linear's
    weight, gradient and (`fp8_activations`) input at steps 1, M+1, ... (`ampwatch.agent.fp8`);
    `fp8_recipe`: the FP8 recipe the run uses or plans, one of `wire.FP8_RECIPES`.

    Gradient accumulation: the step's loss is the mean of its micro-batch losses (those
    `scaler.scale()` saw, or `handle.log_loss()` got); `loss_reduction="sum"` for a loop
    that divides each micro-batch loss by the number of micro-batches before backward, so
    that the stored loss is the undivided one. `start_step`: optimizer steps already taken
    (a resumed run continues its numbering). `min_loss_scale`: the floor of a loss scaler
    that has one (fairseq, DeepSpeed, Megatron `min_loss_scale`; torch's GradScaler has
    none), sent in run_start for the scale rules. Wrapped objects are unwrapped (DDP,
    torch.compile, accelerate's AcceleratedOptimizer, Lightning's LightningOptimizer);
    `accelerator=` (an accelerate `Accelerator`): its scaler is watched, and the loss
    given to `accelerator.backward(loss)`, undivided, is the step's loss. When the loop
    clips (`clip_grad_norm_`), the norm it returned, before clipping, is the grad norm.

    `token` is sent as `Authorization: Bearer <token>`; `offline_file` writes batches to
    that file only (send it later with `ampwatch upload FILE`). `delivery`
    (`ampwatch.agent.delivery.DeliveryOptions`): the spool's folder and bound, the buffer's
    bounds, the retry backoff, the clock; the defaults suit a real run. Arguments win over
    AMPWATCH_* environment variables (`ampwatch.agent.config`).
    `on_critical` (`ampwatch.agent.policy`): what a critical alert does when the collector's
    answer to a batch reports one: "warn" (log it), "stop" (`handle.should_stop`: save a
    checkpoint, stop, `sys.exit(handle.exit_code)`), "raise" (`CriticalAlert` at the next
    step boundary) or a callable `(handle, alerts)` called there; `handle.alerts` lists
    the firing ones. `resume_from`: a resume plan (`ampwatch resume-plan RUN --json`, a
    dict or its file; `ampwatch.agent.resume`): the run continues under the plan's run id
    from its checkpoint's step (`run_id`, `run` and `start_step` default to the plan's) and
    records a `resumed` event.
    `enabled=False` or AMPWATCH_DISABLED=1 returns a handle that does nothing (no hooks, no
    thread). Distributed: rank 0 sends step scalars (all ranks with
    `steps_from_every_rank`), every rank its layer statistics, all tagged with their rank;
    sharded (FSDP2, FSDP1) without a clip, every rank its part of the grad norm.
    Raises TypeError/ValueError on misuse, RuntimeError if an object is already watched.
    """
    check_on_critical(on_critical)
    plan, run_id, run, start_step = _resume(resume_from, run_id, run, start_step)
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
    module, optimizers, scaler = watched_objects(model, optimizer, scaler, accelerator)
    check_arguments(module, optimizers, scaler, settings, flush_interval, max_queue, transport)
    check_delivery(delivery)
    measures = Measures(
        grad_norm=grad_norm,
        steps_from_every_rank=steps_from_every_rank,
        activation_max_abs=activation_max_abs,
        fp8_stats_every=fp8_stats_every,
        fp8_activations=fp8_activations,
        fp8_recipe=fp8_recipe,
        loss_reduction=loss_reduction,
        start_step=start_step,
        min_loss_scale=min_loss_scale,
    ).checked()
    if scaler is not None and not scaler.is_enabled():
        scaler = None
    check_not_watched(module, *optimizers, scaler)
    head = find_final_layer(module, final_layer)
    run_ref, info = _identify(settings, module)  # a collective when distributed
    policy = _alert_policy(on_critical, plan, settings)
    sender = _sender(run_ref, settings, policy, transport, flush_interval, max_queue, delivery)
    handle = _attached(
        module, model, optimizers, scaler, sender, settings, head, run_ref, info, measures, policy
    )
    if accelerator is not None:
        from ampwatch.integrations.accelerate import tap_backward

        handle._detach_actions.append(tap_backward(accelerator, handle))
    sender.start()
    _announce(handle, module, optimizers, scaler, head, settings, measures, info, plan)
    return handle


def _resume(
    resume_from: ResumeFrom | dict[str, Any] | str | os.PathLike[str] | None,
    run_id: str | None,
    run: str | None,
    start_step: int,
) -> tuple[ResumeFrom | None, str | None, str | None, int]:
    """The resume plan, if any, and the run's id, name and first step under it: the plan's
    run id (a different `run_id` is a ValueError), and its name and checkpoint's step unless
    given."""
    if resume_from is None:
        return None, run_id, run, start_step
    plan = load_resume_plan(resume_from)
    if run_id is not None and run_id != plan.client_run_id:
        raise ValueError(
            f"run_id {run_id!r} differs from the resume plan's run {plan.client_run_id!r}"
        )
    return plan, plan.client_run_id, run or plan.name, start_step or plan.step


def _identify(settings: config.Config, module: nn.Module) -> tuple[wire.RunRef, dict[str, Any]]:
    """The run this process reports to (its id shared by every rank, its name, its project)
    and the process (`summary.process_info`)."""
    info = process_info()
    client_run_id = _shared_run_id(settings.run_id, info["world_size"])
    name = settings.run or f"{type(module).__name__}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_ref: wire.RunRef = {"client_run_id": client_run_id, "name": name}
    if settings.project is not None:
        run_ref["project"] = settings.project
    return run_ref, info


def _alert_policy(
    on_critical: OnCritical, plan: ResumeFrom | None, settings: config.Config
) -> AlertPolicy:
    """What a critical alert does; the alerts the resume plan answered are ignored, and
    offline no answer comes."""
    policy = AlertPolicy(on_critical, ignore=plan.alert_ids if plan is not None else ())
    if settings.offline_file is not None:
        policy.unanswered("offline mode (offline_file)")
    return policy


def _sender(
    run_ref: wire.RunRef,
    settings: config.Config,
    policy: AlertPolicy,
    transport: Transport | None,
    flush_interval: float,
    max_queue: int,
    delivery: DeliveryOptions | None,
) -> Sender:
    """The sender thread, not started: HTTP to the collector unless offline or given a
    transport; the collector's answers go to the alert policy."""
    if transport is None and settings.offline_file is None:
        transport = http_transport(settings.url)
    return Sender(
        run_ref,
        transport,
        token=settings.token,
        offline_file=settings.offline_file,
        flush_interval=flush_interval,
        max_queue=max_queue,
        delivery=DeliveryOptions() if delivery is None else delivery,
        on_answer=policy.hear,
    )


def _attached(
    module: nn.Module,
    passed: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    scaler: torch.amp.GradScaler | None,
    sender: Sender,
    settings: config.Config,
    head: tuple[str, nn.Module, bool] | None,
    run_ref: wire.RunRef,
    info: dict[str, Any],
    measures: Measures,
    policy: AlertPolicy,
) -> AttachedHandle:
    """The live handle on `module` (`passed`: what watch() got, maybe compiled), with the
    alert policy and, when asked and steps are automatic, FP8 readiness."""
    send_steps = sends_steps(info["rank"], every_rank=measures.steps_from_every_rank)
    compiled_as = None
    if compiled.forget_compiled_code(passed, module) or compiled.is_compiled(passed):
        compiled_as = passed
    handle = AttachedHandle(
        module,
        optimizers,
        scaler,
        sender=sender,
        settings=settings,
        measure_grad_norm=measures.grad_norm,
        final_layer=head,
        client_run_id=run_ref["client_run_id"],
        rank=info["rank"],
        world_size=info["world_size"],
        send_steps=send_steps,
        activation_max_abs=measures.activation_max_abs,
        loss_reduction=measures.loss_reduction,
        start_step=measures.start_step,
        compiled_as=compiled_as,
    )
    handle._policy = policy
    if measures.fp8_stats_every and optimizers:
        handle._fp8 = fp8.Fp8Monitor(
            module,
            every=measures.fp8_stats_every,
            activations=measures.fp8_activations and compiled_as is None,
            rank=info["rank"],
            on_error=handle._on_error,
            to_host=to_host,
        )
        handle._detach_actions.append(handle._fp8.disarm)
    return handle


def _announce(
    handle: AttachedHandle,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    scaler: torch.amp.GradScaler | None,
    head: tuple[str, nn.Module, bool] | None,
    settings: config.Config,
    measures: Measures,
    info: dict[str, Any],
    plan: ResumeFrom | None,
) -> None:
    """What the run says at attach: run_start (what is watched, and how), `resumed` under a
    plan, and the findings the parameters already show."""
    handle._event(
        "run_start",
        None,
        {
            "model": model_summary(module),
            "optimizers": [optimizer_summary(o) for o in optimizers],
            "scaler": scaler_config(scaler) if scaler is not None else None,
            wire.MIN_LOSS_SCALE: measures.min_loss_scale,
            "precision": guess_precision(module, scaler is not None, compute_dtype(module)),
            "final_layer": None
            if head is None
            else {"name": head[0], "measures": "input" if head[2] else "output"},
            "layer_stats_every": settings.layer_stats_every,
            "grad_norm": measures.grad_norm,
            "activation_max_abs": measures.activation_max_abs,
            "fp8_stats_every": measures.fp8_stats_every,
            "fp8_recipe": measures.fp8_recipe,
            "mode": "automatic" if optimizers else "manual",
            "sharding": handle._sharded,
            "shard_replicas": handle._shard_replicas,  # ranks holding each shard
            "step_scalars_from": "every rank" if measures.steps_from_every_rank else "rank 0",
            **info,
        },
    )
    if plan is not None and info["rank"] == 0:  # once: it resolves the run's open alerts
        handle._event("resumed", plan.step, plan.summary())
    attach_findings(handle, module, scaler is None and bool(optimizers))
