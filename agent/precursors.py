"""Precursors of a divergence read from an Adam-family optimizer's own state, every `EVERY`
steps, on the device, without a host read or a collective.

Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training
instabilities", arXiv 2304.13013) found that loss spikes "consistently occur 1-8
iterations after" AdamW's second moment falls behind the squared gradients. Their
measure, the one StableAdamW clips on, is per parameter tensor (a layer)

    adam_rms = sqrt(mean(g_t**2 / max(v_hat_t, eps**2))),  v_hat_t = v_t / (1 - beta2**t)

with `v_t` the optimizer's `exp_avg_sq` after the step. In steady training it sits near 1
whatever the layer's gradient scale (the second moment is the running mean of g**2); when
the gradient outgrows what the optimizer has seen it climbs towards sqrt(1 / (1 - beta2))
(4.5 at beta2 = 0.95). A log-reading tool cannot see it: the agent holds the optimizer.

Besides it, each layer's update against its weight, `update_ratio` =
||lr * m_hat / (sqrt(v_hat) + eps)|| / ||w|| (Adam's own step, weight decay left out).

Every `EVERY` steps (and on every layer-statistics step) the agent sends the maximum over
layers of the first (`adam_rms_max`): a window of 1-8 steps is missed by a sample every 50,
and at most 3 steps of it by one every 4; the second (`update_ratio_max`, three more
passes) on the layer-statistics steps (`layer_stats_every`). The cost is a handful of
`torch._foreach_*` kernels over at most `MAX_ELEMENTS` elements of each layer (exact below
that, an even-strided estimate above it), plus the Python walk over the optimizer's state.
Measured (`bench/agent_overhead.py --quick`, old and new code interleaved, CPU, load 4-6):
taken every step, the agent's per-step work went from ~0.5 ms to 5-7 ms, 2.6-3.6% of the
0.1M model's bare step, over the defaults bar (<= 3%); one step in `EVERY` divides that.

Read as the optimizer left them, after `step()` (the scaler path: at `scaler.update()`,
with the gradients already unscaled, fused kernels included; a skipped step left the
moments alone and its gradients non-finite: the collector ignores skipped steps' values).
The bias correction uses the state's `step`, a CPU tensor for plain and foreach Adam and a
device tensor for fused or capturable ones, kept a tensor either way (no host read). The eps floor is taken as eps**2 on v_t rather than on v_hat_t, which differs only
where the second moment is ~0 (`eps**2` = 1e-16), so that the floor stays a host number.

Under FSDP the gradients and moments are DTensors: each rank measures its local shards
(`shards.local_tensor`), so a layer is a rank's shard of it, and the step's maximum is
that rank's (rank 0 sends the step record).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ampwatch.agent.shards import local_tensor

_ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")

#: Elements read per layer: a larger layer is read at an even stride (the same elements of
#: its gradient, moments and weight), an estimate of its mean and norm ratio. Reading every
#: element cost 6% of a step of the 3M overhead model on the CPU; the stride makes the cost
#: per layer bounded, and a lagging second moment shows across a layer, not in a few
#: elements (the spikes Wortsman et al. trace are layer-wide: embeddings, QK projections).
MAX_ELEMENTS = 4096

#: Steps between two reads of `adam_rms_max` (besides every layer-statistics step): the
#: divisor of the precursors' cost (see above); the collector's rules judge the values
#: that arrive, whatever their spacing.
EVERY = 4


def _sampled(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` flat, at most `MAX_ELEMENTS` of it at an even stride (a view: no copy)."""
    flat = tensor.reshape(-1)
    stride = -(-flat.numel() // MAX_ELEMENTS)
    return flat if stride == 1 else flat[::stride]


@dataclass(frozen=True)
class _Group:
    """One param group's tensors that have Adam state and a gradient, on one device."""

    grads: list[torch.Tensor]
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]
    weights: list[torch.Tensor]
    step: Any  # a tensor (CPU or device) or a number
    lr: Any
    beta1: float
    beta2: float
    eps: float


def _adam_groups(optimizers: list[torch.optim.Optimizer]) -> list[_Group]:
    groups: list[_Group] = []
    for optimizer in optimizers:
        state = optimizer.state
        for group in optimizer.param_groups:
            betas = group.get("betas")
            eps = group.get("eps")
            if not isinstance(betas, tuple) or not isinstance(eps, (int, float)):
                continue  # not Adam-family
            beta1, beta2 = betas
            if isinstance(beta1, torch.Tensor) or isinstance(beta2, torch.Tensor):
                continue  # tensor betas (capturable configs): reading them would sync
            grads: list[torch.Tensor] = []
            exp_avg: list[torch.Tensor] = []
            exp_avg_sq: list[torch.Tensor] = []
            weights: list[torch.Tensor] = []
            lists = (grads, exp_avg, exp_avg_sq, weights)
            step: Any = None
            for param in group["params"]:
                grad = param.grad
                entry = state.get(param)
                if grad is None or not entry or any(k not in entry for k in _ADAM_STATE):
                    continue
                tensors = (grad, entry["exp_avg"], entry["exp_avg_sq"], param.detach())
                local = [local_tensor(t.detach()) for t in tensors]
                plain = [t for t in local if t is not None and t.numel()]
                if len(plain) < 4 or any(t.device != plain[0].device for t in plain):
                    continue  # (an unknown subclass; state offloaded to the host: skipped)
                for target, value in zip(lists, plain, strict=True):
                    target.append(_sampled(value))
                step = entry["step"]
            if grads:
                groups.append(
                    _Group(grads, exp_avg, exp_avg_sq, weights, step=step, lr=group.get("lr"), beta1=float(beta1),
                           beta2=float(beta2), eps=float(eps))
                )  # fmt: skip
    return groups


def _number(value: Any) -> torch.Tensor | float:
    """A Python number as it is; a tensor (a CPU `step` or `lr`, or a fused or capturable
    optimizer's on the device) kept a float32 tensor where it lies: never read on the
    host, so the training thread makes no host read for it (a 0-d CPU tensor combines with
    a device tensor as a scalar)."""
    return value.to(torch.float32) if isinstance(value, torch.Tensor) else float(value)


def _bias_correction(beta: float, step: Any) -> torch.Tensor | float:
    """1 - beta**t, a host number or a tensor as the step is."""
    t = _number(step)
    return 1.0 - torch.pow(beta, t) if isinstance(t, torch.Tensor) else 1.0 - beta**t


def _group_precursors(
    group: _Group, *, ratio: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-layer adam_rms and (`ratio`) update_ratio of one group, as 1-d device tensors."""
    floor = group.eps * group.eps
    # sqrt(max(v, eps^2)) for every layer at once; in float32 (bf16 moments stay exact).
    dtype = torch.float32
    grads = [g.to(dtype) for g in group.grads]
    denom = torch._foreach_maximum([v.to(dtype) for v in group.exp_avg_sq], floor)
    torch._foreach_sqrt_(denom)
    scaled = torch._foreach_div(grads, denom)
    # ||g / sqrt(v)|| / sqrt(n): the layer's size divides on the host (a list of numbers:
    # a tensor of them would be a host-to-device copy).
    per_element = [1.0 / math.sqrt(g.numel()) for g in grads]
    grad_rms = torch.stack(torch._foreach_mul(torch._foreach_norm(scaled), per_element))
    bc2 = _bias_correction(group.beta2, group.step)
    root_bc2 = bc2.sqrt() if isinstance(bc2, torch.Tensor) else math.sqrt(bc2)
    rms = grad_rms * root_bc2
    if not ratio:
        return rms, None
    steps = torch._foreach_div([m.to(dtype) for m in group.exp_avg], denom)
    step_norms = torch.stack(torch._foreach_norm(steps))
    weight_norms = torch.stack(torch._foreach_norm([w.to(dtype) for w in group.weights]))
    bc1 = _bias_correction(group.beta1, group.step)
    # m_hat / sqrt(v_hat) = (m / bc1) * sqrt(bc2) / sqrt(v)
    update = step_norms * (_number(group.lr) * root_bc2 / bc1) / weight_norms
    return rms, update


def adam_precursors(
    optimizers: list[torch.optim.Optimizer], *, update_ratio: bool = True
) -> dict[str, torch.Tensor]:
    """The step's `adam_rms_max` and (`update_ratio`) `update_ratio_max` over every layer
    with Adam state and a gradient, as 0-d device tensors; {} when no optimizer is
    Adam-family (or before its first step).

    >>> p = torch.nn.Parameter(torch.ones(4))
    >>> opt = torch.optim.AdamW([p], lr=0.1)
    >>> p.grad = torch.ones(4); opt.step()
    >>> round(float(adam_precursors([opt])["adam_rms_max"]), 3)  # g^2 / v_hat = 1 at t=1
    1.0
    """
    rms: list[torch.Tensor] = []
    ratios: list[torch.Tensor] = []
    for group in _adam_groups(optimizers):
        layer_rms, layer_ratio = _group_precursors(group, ratio=update_ratio)
        rms.append(layer_rms.max())
        if layer_ratio is not None:
            ratios.append(layer_ratio.max())
    if not rms:
        return {}
    device = rms[0].device
    out = {"adam_rms_max": torch.stack([r.to(device) for r in rms]).max()}
    if ratios:
        out["update_ratio_max"] = torch.stack([r.to(device) for r in ratios]).max()
    return out


def layer_precursors(
    optimizers: list[torch.optim.Optimizer],
) -> list[tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]]:
    """Per group: its layers' weights (to name them), adam_rms and update_ratio per layer
    (1-d device tensors): what `adam_precursors` takes the maximum of (tests, benches)."""
    out = []
    for group in _adam_groups(optimizers):
        rms, ratio = _group_precursors(group)
        assert ratio is not None
        out.append((group.weights, rms, ratio))
    return out
