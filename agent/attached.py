"""The live handle: what `watch()` attached (hooks, the scaler tap, the clip checks, the
sender) and the bookkeeping around it: detach, findings, the manual `record()`.

The per-step measuring it inherits from `ampwatch.agent.sampling`.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ampwatch.agent import clipping, compiled, config, fp8, shards
from ampwatch.agent.handle import Lifecycle
from ampwatch.agent.hooks import ActivationMaxAbs, ActivationNorm, PrecisionProbe
from ampwatch.agent.manual import manual_sample
from ampwatch.agent.prenorm import attach_prenorm, take_prenorm
from ampwatch.agent.records import LayerSample, StepSample
from ampwatch.agent.sampling import StepSampling, to_host
from ampwatch.agent.scaler import ScalerTap
from ampwatch.agent.stats import RunningMean
from ampwatch.agent.summary import BF16, FP8, FP16, params_of_dtype
from ampwatch.agent.transport import Sender

#: Objects some live handle is attached to; a second `watch()` on one of them is an error.
attached: weakref.WeakSet[object] = weakref.WeakSet()


def check_not_watched(*objects: object) -> None:
    """RuntimeError when one of `objects` is watched already (by a handle not detached)."""
    for obj in objects:
        if obj is not None and obj in attached:
            raise RuntimeError(
                f"this {type(obj).__name__} is already watched; detach() the first handle "
                "before calling watch() again"
            )


class AttachedHandle(StepSampling):
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
        world_size: int,
        send_steps: bool,
        activation_max_abs: bool,
        loss_reduction: str,
        start_step: int,
        compiled_as: nn.Module | None = None,
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
        self._map_parameters(model)
        self._world_size = world_size
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
        self._hook_activations(model, final_layer, compiled_as, activation_max_abs)
        self._hook_precision(model, compiled_as)
        self._hook_steps(model, optimizers, scaler)
        self._watched = [o for o in (model, *optimizers, scaler) if o is not None]
        attached.update(self._watched)
        atexit.register(self._at_exit)
        self._detach_actions.insert(0, self._release)

    def _map_parameters(self, model: nn.Module) -> None:
        """The model's parameters by name, and how they are sharded across the ranks."""
        #: Walked once: `named_parameters()` recurses through every module on each call
        #: (~65 us of a 3M-parameter model's per-step work); parameters added to the model
        #: after watch() are not measured. Named as the user's model names them (`shards`).
        self._named_params = shards.named_parameters(model)
        self._sharded = shards.sharding(model, (p for _, p in self._named_params))
        fsdp1 = self._sharded == "fsdp1"
        #: On how many ranks an FSDP1 shard is held (`shards.fsdp1_replicas`).
        self._plain_replicas = shards.fsdp1_replicas(model) if fsdp1 else None
        #: On how many ranks each shard is held, for run_start (FSDP2: HSDP's replicas).
        self._shard_replicas = (
            shards.dtensor_replicas(p for _, p in self._named_params)
            if self._sharded == "fsdp2"
            else self._plain_replicas
        )

    def _hook_activations(
        self,
        model: nn.Module,
        final_layer: tuple[str, nn.Module, bool] | None,
        compiled_as: nn.Module | None,
        activation_max_abs: bool,
    ) -> None:
        """The final layer's activation norm and its norm's input (every step); the leaves'
        max-abs on sampled steps, unless the model runs compiled."""
        self._act: ActivationNorm | None = None
        if final_layer is not None:
            self._act = ActivationNorm(self._on_error)
            self._add_hook(self._act.attach(final_layer[1], final_layer[2]))
        self._prenorm = attach_prenorm(model, final_layer, self._on_error, self._add_hook)
        #: Whether the model runs under torch.compile (`compiled_as`: the compiled object
        #: watch() got), or is found to after the first step: no sampled-step hooks then.
        self._compiled = compiled_as is not None
        self._compile_checked = self._compiled
        self._act_max: ActivationMaxAbs | None = None
        if self._compiled:
            compiled.say_sampled_hooks_off()
        elif activation_max_abs and self._optimizers:
            # Sent with the layer statistics: automatic mode only.
            self._act_max = ActivationMaxAbs(model, self._on_error)
            self._act_max.arm()  # step 1 is sampled
            self._detach_actions.append(self._act_max.disarm)

    def _hook_precision(self, model: nn.Module, compiled_as: nn.Module | None) -> None:
        """The precision probe: autocast and FP8 modules, seen at the first forward."""
        device = next((p.device.type for p in model.parameters()), "cpu")
        self._probe = PrecisionProbe(device, self._on_precision, self._on_error)
        if compiled_as is None:
            self._probe.attach(model)
        elif compiled_as is not model:  # an OptimizedModule: its own hooks run eagerly
            self._probe.attach(model, root=compiled_as)
        self._detach_actions.append(self._probe.finish)

    def _hook_steps(
        self,
        model: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        scaler: torch.amp.GradScaler | None,
    ) -> None:
        """Where a step ends (the scaler's update, else the first optimizer's step) and the
        loop's clips around it."""
        if optimizers:
            self._detach_actions.append(clipping.observe(self._on_clip))
        check: clipping.ScaledClipCheck | None = None
        if scaler is not None:
            check = self._tap_scaler(scaler, optimizers)
        elif optimizers:
            # Several optimizers without a scaler: the first one's step is the training step.
            first = optimizers[0]
            self._add_hook(first.register_step_pre_hook(self._optimizer_pre_step))
            self._add_hook(first.register_step_post_hook(self._optimizer_post_step))
            self._add_hook(first.register_step_post_hook(self._at_boundary))  # after it
        if optimizers:  # after ScaledClipCheck: it runs first and flags still-scaled grads
            self._detach_actions.append(clipping.register(self._before_clip))
            self._tap_fsdp1_clip(model, check)

    def _tap_scaler(
        self, scaler: torch.amp.GradScaler, optimizers: list[torch.optim.Optimizer]
    ) -> clipping.ScaledClipCheck:
        """The scaler's tap (a step per `update()`) and the check for a clip before
        `unscale_`, which it returns."""
        self._tap = ScalerTap(
            scaler,
            before_update=self._before_update,
            after_update=self._emit,
            on_error=self._on_error,
            boundary=self._at_boundary,
        )
        self._tap.attach()
        self._scaled_loss = self._tap.loss
        self._detach_actions.append(self._tap.detach)
        check = clipping.ScaledClipCheck(scaler, optimizers, self._on_scaled_clip, self._on_error)
        self._detach_actions.append(clipping.register(check))
        return check

    def log_loss(self, loss: torch.Tensor | float) -> None:
        if self._state is not Lifecycle.ATTACHED:
            return
        try:
            if isinstance(loss, torch.Tensor):
                value = loss.detach()
                self._loss.add(value.float().mean() if value.dim() else value)
            else:
                self._loss.add(torch.tensor(float(loss)))
        except Exception as exc:  # noqa: BLE001 - reported, never raised into training
            self._on_error(exc)

    def _emit(self, prepared: tuple[StepSample | None, LayerSample | None]) -> None:
        if not self._compile_checked:  # the first step's forwards have run
            self._compile_checked = True
            if self._probe.traced:
                self._compiled_after_watch()
        super()._emit(prepared)

    def _compiled_after_watch(self) -> None:
        """The model was compiled after watch(): stop adding hooks for sampled steps (each
        change to a hooked module's hooks recompiles it)."""
        self._compiled = True
        if self._act_max is not None:
            self._act_max.disarm()
            self._act_max = None
        if self._fp8 is not None:
            self._fp8.stop_activations()
        compiled.say_sampled_hooks_off()

    def _record(self, step: int | None, values: dict[str, object]) -> None:
        try:
            number = self._step + 1 if step is None else int(step)
            logged = self._take_loss()  # log_loss() calls since the last step
            if values["loss"] is None:
                values["loss"] = logged
            if self._act is not None and (act := self._act.take()) is not None:
                values["act_norm_mean"], values["act_norm_max"] = act
            take_prenorm(self._prenorm, values)
            sample = manual_sample(number, self._rank, values, to_host)
            self._step = number
            if self._send_steps:
                self._send(sample)
        except Exception as exc:  # noqa: BLE001 - reported, never raised into training
            self._on_error(exc)

    def _tap_fsdp1_clip(self, model: nn.Module, check: clipping.ScaledClipCheck | None) -> None:
        """FSDP1 clips through the root's own method, not torch's function: see its calls."""
        roots = shards.fsdp1_modules(model)
        if not roots:
            return

        def before(params: list[torch.Tensor]) -> None:
            if check is not None:
                check(params)
            self._before_clip(params)

        def after(
            params: list[torch.Tensor], total: torch.Tensor, max_norm: Any, norm: Any
        ) -> None:
            try:
                clipped = None
                if isinstance(max_norm, (int, float, torch.Tensor)):
                    clipped = clipping.clipped_norm(total.detach(), max_norm)
            except Exception as exc:  # noqa: BLE001 - reported, never raised into training
                self._on_error(exc)
                return
            self._on_clip(params, total, clipped, norm)

        self._detach_actions.append(shards.tap_fsdp1_clip(roots[0], before, after))

    def _release(self) -> None:
        atexit.unregister(self._at_exit)
        for obj in self._watched:
            attached.discard(obj)

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
            "gradient clipping ran on gradients still multiplied by the loss scale: call "
            "scaler.unscale_(optimizer) before clipping",
            optimizers=optimizers,
            at_step=self._step + 1,
        )


def _str(detail: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v).removeprefix("torch.") for k, v in detail.items()}


def attach_findings(handle: AttachedHandle, model: nn.Module, unscaled: bool) -> None:
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
    # FSDP's policy computes in a dtype its fp32 shards do not show (a code is sent once).
    compute = shards.compute_dtype(model)
    if compute == torch.float16 and unscaled:
        handle._finding(
            "fp16_params_without_scaler",
            "the sharding wrapper's mixed-precision policy computes in float16 and no "
            "enabled GradScaler is watched: small gradients will underflow to zero",
            source="fsdp_mixed_precision",
        )
    if compute == torch.bfloat16:
        handle._finding(
            "bf16_in_use",
            "the sharding wrapper's mixed-precision policy computes in bfloat16",
            source="fsdp_mixed_precision",
        )
    if shards.has_flat_params(name for name, _ in handle._named_params):
        handle._finding("flat_params", shards.FLAT_PARAMS)
    if fp8 := params_of_dtype(model, FP8, buffers=True):
        handle._finding(
            "fp8_in_use",
            f"{len(fp8)} parameter or buffer tensors are stored in an FP8 dtype",
            source="parameters",
            params=fp8[:20],
            count=len(fp8),
        )
