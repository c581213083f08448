"""FP8 readiness: what each Linear layer's tensors would lose if cast to FP8, measured in-run.

Every M steps (`DEFAULT_EVERY`) the agent measures, for every `nn.Linear`'s weight, weight
gradient and (optionally) input activation, under each scaling of `wire.FP8_SCALINGS` and
each format of `wire.FP8_FORMATS`: the share of elements that would flush to zero, the
share that would saturate, and the relative quantisation error; plus the spread of the
per-group scales. Everything is computed on the device and gathered into one tensor per
sample whose host copy starts without waiting (the same path as the gradient-range
statistics); the sender thread turns the counts into shares (`Fp8Sample.records`).

Semantics (one home: `quantisation_counts`; the tests check them against torch's own
`float8_e4m3fn` / `float8_e5m2` casts, group by group):

- A tensor is viewed as 2-D (rows = every leading dim, columns = the last: a weight's input
  channels, an activation's channels). `tensor`: one scale. `tile`: 1x128 along a row
  (DeepSeek-V3's activations). `block`: 128x128 (DeepSeek-V3's weights). `mx`: 1x32 along a
  row with an E8M0 (power-of-two) scale 2^e, e the smallest integer with amax <= fmax * 2^e
  (clamped to [-127, 127]): the scale rounded up, as Transformer Engine's MXFP8 quantiser
  does, so nothing saturates; OCP MX's floor(log2 amax) - emax rule would clip the top
  ~0.4% of Gaussian data. A row or column that does not fill its last group makes a smaller
  group (as zero padding would).
- Current scaling (tensor, tile, block): scale s = fmax / amax in float32 (amax of the
  group; s = 1 for an all-zero group), as Transformer Engine's current scaling and
  DeepSeek-V3's `amax / 448` do. y = |x| * s in float32, then a saturating cast.
- flush: x != 0 and the cast of y is 0; saturate: y rounds past fmax (a non-saturating
  cast gives Inf/NaN; the saturating one clips to fmax). Both over all elements (Transformer Engine's `underflows%` divides by
  numel too). error: ||dequantised - x||_2 / ||x||_2 over the tensor (0 for a zero tensor).
- NaN and +-Inf elements are left out of the scales and of every count and norm (they are
  neither flushed nor saturated, and count as zeros): the scaler skips such a step anyway,
  and one Inf must not make the whole tensor look flushed.
- spread: log2(max group amax / min non-zero group amax), in binary orders of magnitude:
  how far apart the groups' scales are (0 when fewer than one non-zero group).

Cost: no host sync; flush and saturate compare y with the format's rounding threshold and
maximum (equal to the cast's outcome, which the tests check), the error uses the cast.
`bench/fp8_overhead.py` measured it; see `DEFAULT_EVERY`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ampwatch.agent import wire
from ampwatch.agent.compiled import tracing

#: One sample every 200 steps. `bench/fp8_overhead.py` (CPU, 2 loaded cores, CPU time) measured
#: a sampled step of its 3M-parameter model (13 Linear layers: weights, gradients and
#: inputs) at ~1.6 bare steps more, and 0.9 for the 0.1M model: 1 in 100 added ~1.2-1.6%
#: to the step, on top of the rest of the agent, too close to the 3% bar; 1 in 200 adds
#: ~0.8%. FP8 readiness drifts over thousands of steps, not hundreds.
DEFAULT_EVERY = 200

#: name -> (torch dtype, largest finite value fmax, E with fmax = 0.875 * 2^E).
FORMATS: dict[str, tuple[torch.dtype, float, int]] = {
    "e4m3": (torch.float8_e4m3fn, 448.0, 9),
    "e5m2": (torch.float8_e5m2, 57344.0, 16),
}
#: y (float32, >= 0) casts to 0 iff y <= half the smallest subnormal (the tie rounds to
#: even, i.e. to 0): 2^-10 for E4M3 (subnormals from 2^-9), 2^-17 for E5M2 (from 2^-16).
FLUSH_AT: dict[str, float] = {"e4m3": 2.0**-10, "e5m2": 2.0**-17}
#: y saturates iff it rounds past the largest finite value: above 464 for E4M3 (the tie
#: rounds to even, 448), at or above 61440 for E5M2 (the tie rounds up, to Inf); below
#: these, the cast's own rounding gives fmax, with no clipping.
SATURATE_ABOVE: dict[str, float] = {"e4m3": 464.0, "e5m2": 61440.0 - 2.0**-8}
TILE = 128
BLOCK = 128
MX_GROUP = 32
_E8M0_MIN, _E8M0_MAX = -127, 127
_F32_MAX = torch.finfo(torch.float32).max

#: Per tensor, the flat layout of the device vector: for each scaling, for each format,
#: (flush count, saturate count, squared error); then ||x||^2; then one spread per
#: grouped scaling (`wire.FP8_SPREAD_SCALINGS`).
_PER_COMBO = 3
_COMBOS = len(wire.FP8_SCALINGS) * len(wire.FP8_FORMATS)
VALUES_PER_TENSOR = _COMBOS * _PER_COMBO + 1 + len(wire.FP8_SPREAD_SCALINGS)


def check_options(every: int | None, recipe: str | None) -> None:
    """Fail fast at attach time, with the fix in the message."""
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 0):
        raise ValueError(
            f"fp8_stats_every must be an int >= 1, or None to turn it off, got {every!r}"
        )
    if recipe is not None and recipe not in wire.FP8_RECIPES:
        raise ValueError(
            f"fp8_recipe must be one of {sorted(wire.FP8_RECIPES)} or None, got {recipe!r}"
        )


def _grouped(a: torch.Tensor, scaling: str) -> torch.Tensor:
    """`a` (2-D, >= 0) as [groups..., elements] views with zero padding where a row or
    column does not fill its last group; padding is zero, so it moves no count."""
    rows, cols = a.shape
    if scaling == "tensor":
        return a.reshape(1, -1)
    width = MX_GROUP if scaling == "mx" else TILE
    if scaling in ("tile", "mx"):
        pad = -cols % width
        if pad:
            a = torch.nn.functional.pad(a, (0, pad))
        return a.reshape(rows, -1, width)
    pad_rows, pad_cols = -rows % BLOCK, -cols % BLOCK
    if pad_rows or pad_cols:
        a = torch.nn.functional.pad(a, (0, pad_cols, 0, pad_rows))
    r, c = a.shape
    return (
        a.reshape(r // BLOCK, BLOCK, c // BLOCK, BLOCK)
        .permute(0, 2, 1, 3)
        .reshape(r // BLOCK, c // BLOCK, BLOCK * BLOCK)
    )


def group_scales(amax: torch.Tensor, fmt: str, scaling: str) -> torch.Tensor:
    """The multiplier s per group (float32): fmax / amax for current scaling, 2^-(shared
    exponent) for MX; 1 for an all-zero group.

    >>> group_scales(torch.tensor([2.0, 0.0, 600.0]), "e4m3", "mx")
    tensor([128.0000,   1.0000,   0.5000])
    >>> group_scales(torch.tensor([3.6]), "e4m3", "mx")  # 3.6 * 128 > 448: rounded up
    tensor([64.])
    """
    _, fmax, top = FORMATS[fmt]
    positive = amax > 0
    if scaling == "mx":
        # Exactly, with amax = m * 2^e (m in [0.5, 1)): amax <= 0.875 * 2^(top + s) iff
        # s >= e - top, plus one when m > 0.875.
        mantissa, exponent = torch.frexp(amax)
        shared = (exponent - top + (mantissa > 0.875).int()).clamp_(_E8M0_MIN, _E8M0_MAX)
        scale = torch.ldexp(torch.ones_like(amax), -shared)
    else:
        # A true division (`fmax / tensor` would multiply by a rounded reciprocal).
        scale = torch.full_like(amax, fmax).div_(amax).clamp_(max=_F32_MAX)
    return torch.where(positive, scale, torch.ones_like(amax))


def quantisation_counts(x: torch.Tensor) -> torch.Tensor:
    """Launch the FP8 reductions for one tensor; return its float64 device vector
    (`VALUES_PER_TENSOR` values; layout above). Never syncs.

    >>> v = quantisation_counts(torch.tensor([[1.0, 1e-6, 0.0]]))
    >>> v[0].item(), v[1].item()  # per-tensor E4M3: 1e-6 * 448 < 2^-10 flushes; none saturate
    (1.0, 0.0)
    """
    a = torch.nan_to_num(x.detach().float(), 0.0, 0.0, 0.0).abs_()
    a = a.reshape(1, -1) if a.dim() < 2 else a.reshape(-1, a.shape[-1])
    parts: list[torch.Tensor] = []
    spreads: list[torch.Tensor] = []
    norm_sq: torch.Tensor | None = None
    for scaling in wire.FP8_SCALINGS:
        groups = _grouped(a, scaling)
        amax = groups.amax(dim=-1, keepdim=True)
        zeros = (groups == 0).sum()
        for fmt in wire.FP8_FORMATS:
            dtype, fmax, _ = FORMATS[fmt]
            scale = group_scales(amax, fmt, scaling)
            y = groups * scale
            if norm_sq is None:  # ||x||^2 from the scaled values: |x|^2 underflows float32
                norm_sq = (y.square().sum(dtype=torch.float64) / scale.double().square()).sum()
            parts.append((y <= FLUSH_AT[fmt]).sum() - zeros)
            parts.append((y > SATURATE_ABOVE[fmt]).sum())
            # Quantisation error in the scaled domain, brought back per group by 1/s^2
            # (in float64: s^2 overflows float32 for tiny groups).
            diff = y.clamp(max=fmax).to(dtype).float().sub_(y)
            group_sq = diff.square_().sum(dim=-1, keepdim=True, dtype=torch.float64)
            parts.append((group_sq / scale.double().square()).sum())
        if scaling != "tensor":
            top = amax.max()
            low = torch.where(amax > 0, amax, torch.full_like(amax, math.inf)).min()
            spread = torch.where(top > 0, torch.log2(top / low), torch.zeros_like(top))
            spreads.append(spread)
    assert norm_sq is not None
    parts.append(norm_sq)
    return torch.cat(
        [torch.stack([p.to(torch.float64) for p in parts]), torch.stack(spreads).to(torch.float64)]
    )


def shares(values: Sequence[float], numel: int) -> dict[str, float]:
    """Host side: one tensor's `quantisation_counts` -> {"{fmt}_{scaling}_{metric}": v,
    "{scaling}_spread": v}, the suffixes of `wire.fp8_stat` names.

    >>> s = shares([0.0] * 24 + [0.0, 0.0, 0.0, 0.0], 4)
    >>> s["e4m3_tensor_flush"], s["e4m3_tensor_error"], s["tile_spread"]
    (0.0, 0.0, 0.0)
    """
    out: dict[str, float] = {}
    norm_sq = values[_COMBOS * _PER_COMBO]
    i = 0
    for scaling in wire.FP8_SCALINGS:
        for fmt in wire.FP8_FORMATS:
            flush, saturate, err_sq = values[i : i + _PER_COMBO]
            i += _PER_COMBO
            out[f"{fmt}_{scaling}_flush"] = flush / numel
            out[f"{fmt}_{scaling}_saturate"] = saturate / numel
            out[f"{fmt}_{scaling}_error"] = math.sqrt(err_sq / norm_sq) if norm_sq > 0 else 0.0
    for j, scaling in enumerate(wire.FP8_SPREAD_SCALINGS):
        out[f"{scaling}_spread"] = values[_COMBOS * _PER_COMBO + 1 + j]
    return out


@dataclass(slots=True)
class Fp8Sample:
    """One FP8 sample: per role, (weight names, numels, count of tensors), all roles' vectors
    in one host tensor `values` (maybe still being copied; `ready` is its CUDA event)."""

    step: int
    rank: int
    roles: list[tuple[str, list[str], list[int]]]
    values: torch.Tensor
    ready: torch.cuda.Event | None

    def records(self) -> list[wire.LayerStatsRecord]:
        """The wire records, one per measured role (each role measures its own layers: a
        frozen weight has no gradient, an unused Linear no activation). Sender thread."""
        if self.ready is not None:
            self.ready.synchronize()
        flat = self.values.tolist()
        out: list[wire.LayerStatsRecord] = []
        at = 0
        for role, names, numels in self.roles:
            stats: dict[str, list[float]] = {}
            for numel in numels:
                vector = flat[at : at + VALUES_PER_TENSOR]
                at += VALUES_PER_TENSOR
                for suffix, value in shares(vector, numel).items():
                    stats.setdefault(f"fp8_{role}_{suffix}", []).append(value)
            out.append(
                {
                    "step": self.step,
                    "rank": self.rank,
                    "names": names,
                    "stats": {name: wire.encode_floats(v) for name, v in stats.items()},
                }
            )
        return out


def _linear_weights(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Each nn.Linear with its weight's name as `named_parameters()` gives it, the name
    the gradient statistics use: a tied weight (GPT-2's `lm_head` is `transformer.wte`'s)
    is one tensor under one name, measured once, through the first Linear that uses it."""
    names = {id(param): name for name, param in model.named_parameters()}
    layers: dict[str, nn.Linear] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear) and (name := names.get(id(module.weight))):
            layers.setdefault(name, module)
    return list(layers.items())


class Fp8Monitor:
    """Samples every `every` steps (1, every+1, ...); `activations`: the inputs of each
    Linear in that step's graph-building forwards, through forward pre-hooks registered only
    for that step (micro-batches are summed, spreads take the max).

    The caller calls `after_step(step)` once each optimizer step, while the gradients are
    still there; it returns the sample to send (or None) and never raises.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        every: int = DEFAULT_EVERY,
        activations: bool = True,
        rank: int = 0,
        on_error: Callable[[BaseException], None],
        to_host: Callable[[torch.Tensor], tuple[torch.Tensor, torch.cuda.Event | None]],
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"fp8_stats_every must be an int >= 1, got {every!r}")
        self._layers = _linear_weights(model)
        self._every = every
        self._activations = activations
        self._rank = rank
        self._on_error = on_error
        self._to_host = to_host
        self._handles: list[RemovableHandle] = []
        self._inputs: dict[str, list[tuple[torch.Tensor, int]]] = {}
        self._arm_for(1)

    def after_step(self, step: int) -> Fp8Sample | None:
        sample = None
        try:
            if (step - 1) % self._every == 0 and self._layers:
                sample = self._sample(step)
        except Exception as exc:  # noqa: BLE001 - a failure costs the sample, never the step
            self._on_error(exc)
        self.disarm()
        self._arm_for(step + 1)
        return sample

    def stop_activations(self) -> None:
        """No activation hooks from the next step on (a compiled model: `compiled.py`)."""
        self._activations = False

    def disarm(self) -> None:
        """Remove the activation hooks and drop what they measured (detach calls this)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._inputs = {}

    def _arm_for(self, step: int) -> None:
        if self._activations and (step - 1) % self._every == 0:
            for name, module in self._layers:
                self._handles.append(module.register_forward_pre_hook(self._hook_for(name)))

    def _hook_for(self, name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if tracing() or not torch.is_grad_enabled() or not args:
                return
            try:
                x = args[0]
                if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
                    self._inputs.setdefault(name, []).append((quantisation_counts(x), x.numel()))
            except Exception as exc:  # noqa: BLE001 - never let the agent break a forward pass
                self._on_error(exc)

        return hook

    def _sample(self, step: int) -> Fp8Sample:
        roles: list[tuple[str, list[str], list[int]]] = []
        vectors: list[torch.Tensor] = []

        def add(role: str, measured: list[tuple[str, torch.Tensor, int]]) -> None:
            if measured:
                roles.append((role, [m[0] for m in measured], [m[2] for m in measured]))
                vectors.extend(m[1] for m in measured)

        weights = [(n, m.weight) for n, m in self._layers if m.weight.numel()]
        add("weight", [(n, quantisation_counts(w), w.numel()) for n, w in weights])
        add(
            "grad",
            [
                (n, quantisation_counts(w.grad), w.numel())
                for n, w in weights
                if w.grad is not None and not w.grad.is_sparse
            ],
        )
        add("act", [(n, *_fold(self._inputs[n])) for n, _ in self._layers if n in self._inputs])
        device = vectors[0].device
        flat = torch.cat([v.to(device, non_blocking=True) for v in vectors])
        values, ready = self._to_host(flat)
        return Fp8Sample(step, self._rank, roles, values, ready)


def _fold(inputs: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, int]:
    """One layer's inputs over a step's micro-batches: counts and squared norms add (so the
    shares are over every input element), spreads take the max."""
    numel = sum(n for _, n in inputs)
    if len(inputs) == 1:
        return inputs[0][0], numel
    stacked = torch.stack([v for v, _ in inputs])
    head = VALUES_PER_TENSOR - len(wire.FP8_SPREAD_SCALINGS)
    return torch.cat([stacked[:, :head].sum(0), stacked[:, head:].amax(0)]), numel
