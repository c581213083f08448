"""FP8 readiness: what each Linear layer's tensors would lose if cast to FP8, measured in-run.

Every M steps (`DEFAULT_EVERY`) the agent measures, for every `nn.Linear`'s weight, weight
gradient and (optionally) input activation, under each scaling of `wire.FP8_SCALINGS` and
each format of `wire.FP8_FORMATS`: the share of elements that would flush to zero, the
share that would saturate, and the relative quantisation error; plus the spread of the
per-group scales. A GPU tensor's are computed on the device by kernels launched from the
training thread and gathered into one tensor per sample whose host copy starts without
waiting (the same path as the gradient-range statistics). A CPU tensor is copied (up to
`_COPY_BYTES` a sample) and measured on the sender thread, off the training loop's path.
The sender turns the counts into shares (`Fp8Sample.records`).

What a tensor's counts are, and how one read of it gives them: `ampwatch.agent.fp8_counts`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ampwatch.agent import shards, wire
from ampwatch.agent.compiled import tracing
from ampwatch.agent.fp8_counts import (
    VALUES_PER_TENSOR,
    Workspace,
    batch_key,
    quantisation_counts,
    shares,
)

#: One sample every 500 steps. `bench/fp8_overhead.py` (CPU, one torch thread, 2 cores
#: shared, load average < 1) measured a step that samples against one that does not, with
#: a shape's tensors measured in one call: 1.02x / 1.02x / 1.08x on the training loop's
#: wall clock for its 5x 200x333-Linear model / 0.1M / 3M models (the statistics of CPU
#: tensors run on the sender thread), and 2.23x / 1.28x / 1.52x in the process's CPU time,
#: all threads (one call per tensor, before: 2.74x / 1.40x / 1.44x). 1 in 500 averages
#: <= 0.3% CPU per step on all three (the bar is 1%; 1 in 200 would be ~0.6% on the
#: first). FP8 readiness drifts over thousands of steps, not hundreds.
DEFAULT_EVERY = 500

#: The most bytes of CPU tensors one sample copies for the sender thread to measure (the
#: rest it measures on the training thread).
_COPY_BYTES = 1 << 28


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


@dataclass(frozen=True, slots=True)
class _Later:
    """A tensor measured later, with the others of its 2-D shape (`_resolved`): a copy of a
    CPU tensor, on the sender thread (`Fp8Sample.records`), or (`copy` False) a weight or
    gradient as it is, on the training thread at the end of its sample."""

    tensor: torch.Tensor
    copy: bool = True


#: One measured tensor, or one layer's inputs over a step's micro-batches: counts vectors
#: (`quantisation_counts`) and tensors still to measure.
_Parts = list[torch.Tensor | _Later]


@dataclass(slots=True)
class Fp8Sample:
    """One FP8 sample: per role, (weight names, numels, count of tensors), all roles' vectors
    in one host tensor `values` (maybe still being copied; `ready` is its CUDA event), or,
    when it holds copies of CPU tensors (`later`), None until the sender measures them."""

    step: int
    rank: int
    roles: list[tuple[str, list[str], list[int]]]
    values: torch.Tensor | None
    ready: torch.cuda.Event | None
    later: list[_Parts] | None = None
    workspace: Workspace | None = None
    on_error: Callable[[BaseException], None] | None = None

    def records(self) -> list[wire.LayerStatsRecord]:
        """The wire records, one per measured role (each role measures its own layers: a
        frozen weight has no gradient, an unused Linear no activation). Sender thread:
        measures the CPU copies first; a failure there costs the sample, never the
        sender."""
        if self.later is not None:
            try:
                self.values = _measured(self.later, self.workspace)
            except Exception as exc:  # noqa: BLE001 - an odd tensor must not stop the sender
                if self.on_error is not None:
                    self.on_error(exc)
                return []
            finally:
                self.later = None
        if self.ready is not None:
            self.ready.synchronize()
        assert self.values is not None
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


def _measured(entries: list[_Parts], workspace: Workspace | None) -> torch.Tensor:
    """Every entry's counts vector, in order, on the first entry's device: what is left to
    measure measured now (`_resolved`), a layer's micro-batches folded (`_fold`)."""
    resolved = _resolved(entries, workspace, lambda later: True)
    vectors = [_fold(cast("list[torch.Tensor]", parts)) for parts in resolved]
    device = vectors[0].device
    return torch.cat([v.to(device, non_blocking=True) for v in vectors])


def _resolved(
    entries: list[_Parts], workspace: Workspace | None, which: Callable[[_Later], bool]
) -> list[_Parts]:
    """`entries` with each `_Later` that `which` picks replaced by its counts vector: one
    `quantisation_counts` call per 2-D shape and device (`batch_key`), which a model's
    layers share (one per shape, not one per tensor: the launches cost as much as a small
    tensor's arithmetic)."""
    out = [list(parts) for parts in entries]
    places: dict[tuple[int, int, torch.device], list[tuple[int, int]]] = {}
    for i, parts in enumerate(entries):
        for j, part in enumerate(parts):
            if isinstance(part, _Later) and which(part):
                places.setdefault(batch_key(part.tensor), []).append((i, j))
    for batch in places.values():
        tensors = [cast(_Later, entries[i][j]).tensor for i, j in batch]
        for (i, j), vector in zip(batch, quantisation_counts(tensors, workspace), strict=True):
            out[i][j] = vector
    return out


def _linear_weights(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Each nn.Linear with its weight's name as `named_parameters()` gives it, the name
    the gradient statistics use: a tied weight (GPT-2's `lm_head` is `transformer.wte`'s)
    is one tensor under one name, measured once, through the first Linear that uses it."""
    names = {id(param): name for name, param in shards.named_parameters(model)}
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
        self._inputs: dict[str, tuple[_Parts, int]] = {}
        self._workspace = Workspace()  # the training thread's
        self._sender_workspace = Workspace()  # the sender's: it may measure while we do
        self._copied = 0  # bytes of CPU tensors this sample copies for the sender
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
        self._copied = 0

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
                    parts, numel = self._inputs.get(name, ([], 0))
                    parts.append(self._measure(x, now=True))
                    self._inputs[name] = (parts, numel + x.numel())
            except Exception as exc:  # noqa: BLE001 - never let the agent break a forward pass
                self._on_error(exc)

        return hook

    def _measure(self, x: torch.Tensor, *, now: bool) -> torch.Tensor | _Later:
        """A CPU tensor's copy for the sender thread to measure, while this sample's copies
        stay under `_COPY_BYTES`: the training thread pays a copy, not the statistics (a
        CPU runs them as it goes). Else (a GPU tensor: kernels launched in stream order,
        no sync) its counts vector now, or (not `now`: a weight or gradient, which stays
        as it is until the sample ends) the tensor, measured with the others of its shape
        at the end of the sample. An activation is measured at once: a later forward may
        change it in place, and holding it would hold its memory."""
        nbytes = x.numel() * x.element_size()
        if x.device.type == "cpu" and self._copied + nbytes <= _COPY_BYTES:
            self._copied += nbytes
            return _Later(x.detach().clone())
        if not now:
            return _Later(x.detach(), copy=False)
        return quantisation_counts([x], self._workspace)[0]

    def _sample(self, step: int) -> Fp8Sample:
        roles: list[tuple[str, list[str], list[int]]] = []
        entries: list[_Parts] = []

        def add(role: str, measured: list[tuple[str, _Parts, int]]) -> None:
            if measured:
                roles.append((role, [m[0] for m in measured], [m[2] for m in measured]))
                entries.extend(m[1] for m in measured)

        # Sharded weights (FSDP): this rank's local shard, its gradient's likewise.
        weights = [(n, m.weight) for n, m in self._layers]
        local = [(n, w, t) for n, w in weights if (t := shards.local_tensor(w)) is not None]
        add(
            "weight",
            [(n, [self._measure(t, now=False)], t.numel()) for n, _, t in local if t.numel()],
        )
        grads = [
            (n, g)
            for n, w, _ in local
            if w.grad is not None
            and not w.grad.is_sparse
            and (g := shards.local_tensor(w.grad)) is not None
            and g.numel()
        ]
        add("grad", [(n, [self._measure(g, now=False)], g.numel()) for n, g in grads])
        add("act", [(n, *self._inputs[n]) for n, _ in self._layers if n in self._inputs])
        entries = _resolved(entries, self._workspace, lambda later: not later.copy)
        if any(isinstance(p, _Later) for parts in entries for p in parts):
            return Fp8Sample(
                step, self._rank, roles, None, None, entries, self._sender_workspace, self._on_error
            )
        values, ready = self._to_host(_measured(entries, None))
        return Fp8Sample(step, self._rank, roles, values, ready)


def _fold(vectors: list[torch.Tensor]) -> torch.Tensor:
    """One layer's inputs over a step's micro-batches: counts and squared norms add (so the
    shares are over every input element), spreads take the max."""
    if len(vectors) == 1:
        return vectors[0]
    stacked = torch.stack(vectors)
    head = VALUES_PER_TENSOR - len(wire.FP8_SPREAD_SCALINGS)
    return torch.cat([stacked[:, :head].sum(0), stacked[:, head:].amax(0)])
