"""Sharded training (FSDP2, FSDP1, DTensor): what the agent may read from a rank, and how.

Any op on a DTensor may run a collective (`aten.bincount` is not even implemented for one),
and a collective that one rank runs alone hangs or aborts the job. So every reduction the
agent launches runs on a plain tensor: a DTensor's `.to_local()` shard, a plain tensor as it
is; any other tensor subclass is skipped and said once (`local_tensor` returns None). The
host copies (`.tolist()`) on the sender thread then only ever see plain CPU tensors.

What a rank can and cannot know without a collective:
- Per-layer statistics of its local shard: counts are additive across ranks (zero, flush,
  subnormal counts, histograms), max|g| composes by max, so each rank sends its own.
- The global grad norm is over every shard: a rank's local norm is not it. The loop's own
  `clip_grad_norm_` already computed it (FSDP2: a Replicate DTensor, whose local tensor is
  the global norm on every rank; FSDP1's `FullyShardedDataParallel.clip_grad_norm_`: a
  plain tensor), so the agent takes it from there. Without a clip every rank sends its
  part, the sum of squares of its local shards (`local_sumsq`: a shard replicated over a
  mesh dimension counted once in all), and the collector adds the parts of a step from all
  `world_size` ranks (`server/grad_norm_parts.py`); FSDP1's NO_SHARD and hybrid shards count 1/k
  for their k replicas (`fsdp1_replicas`). Where the parts cannot add up exactly (a Partial
  DTensor gradient, a plain gradient beside FSDP2's, FSDP1 ignored modules or mixed
  strategies) no norm is stored and the agent says so once (`GRAD_NORM_SHARDED`).
- Names: wrappers insert path segments (`_fsdp_wrapped_module.`, `_checkpoint_wrapped_module.`,
  `_orig_mod.`); `clean_name` removes them so layers are named as the user's model names
  them. FSDP1 without `use_orig_params=True` holds one flat parameter per wrapped module:
  its per-layer statistics are per flat parameter (`FLAT_PARAMS`, said once).

DTensor and FSDP1 types are looked up in `sys.modules`, never imported: a process that has
not imported them holds none of their tensors, and the agent's import stays light.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ampwatch.agent.patch import patch_method

logger = logging.getLogger("ampwatch.agent")

#: Path segments wrappers insert into parameter and module names.
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
#: The name FSDP1 gives each wrapped module's flat parameter.
FLAT_PARAM = "_flat_param"

GRAD_NORM_SHARDED = (
    "gradients are sharded, the loop did not clip, and this sharding's per-rank sums of "
    "squares do not add up to the global norm (a Partial or unsharded gradient, FSDP1 "
    "ignored modules or mixed strategies): the agent never runs a collective, so grad_norm "
    "is not stored; call clip_grad_norm_ (FSDP2: torch.nn.utils.clip_grad_norm_; FSDP1: "
    "model.clip_grad_norm_, max_norm=float('inf') to measure without clipping) and its "
    "norm is stored"
)
#: FSDP1 strategies under which every rank holds a disjoint shard of each flat parameter.
_DISJOINT_FSDP1 = ("FULL_SHARD", "SHARD_GRAD_OP")
#: FSDP1 strategies that shard within a group and replicate across groups.
_HYBRID_FSDP1 = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
FLAT_PARAMS = (
    "FSDP1 without use_orig_params=True: per-layer statistics are per flat parameter "
    "(one per wrapped module); wrap with use_orig_params=True for per-parameter names"
)

_skipped_types: set[str] = set()


def _dtensor_type() -> type | None:
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor if isinstance(dtensor, type) else None


def is_dtensor(tensor: object) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor | None:
    """The part of `tensor` this rank holds, as a plain tensor; None for a tensor subclass
    the agent does not know (logged once per type: its ops may dispatch anywhere).

    >>> local_tensor(torch.ones(2)).tolist()
    [1.0, 1.0]
    """
    kind = type(tensor)
    if kind is torch.Tensor or kind is nn.Parameter:
        return tensor
    if is_dtensor(tensor):
        local: torch.Tensor = tensor.to_local()  # type: ignore[attr-defined]
        wait = getattr(local, "wait", None)  # AsyncCollectiveTensor: the loop's own collective
        if type(local) is not torch.Tensor and callable(wait):
            local = wait()
        return local if type(local) in (torch.Tensor, nn.Parameter) else None
    name = f"{kind.__module__}.{kind.__qualname__}"
    if name not in _skipped_types:
        _skipped_types.add(name)
        logger.warning("ampwatch: %s tensors are not measured (an unknown tensor subclass)", name)
    return None


def scalar(tensor: torch.Tensor) -> torch.Tensor | None:
    """A one-element device value (0-d or 1-d: ShardedGradScaler keeps its found-inf flags as
    shape (1,)) as a plain 0-d tensor, ready to stack; None when it is not one.

    >>> scalar(torch.ones(1)).shape, scalar(torch.ones(2))
    (torch.Size([]), None)
    """
    local = local_tensor(tensor.detach())
    if local is None or local.numel() != 1:
        return None
    return local.reshape(())


def clean_name(name: str) -> str:
    """`name` as the user's model names it, without wrapper path segments.

    >>> clean_name("_fsdp_wrapped_module.blocks.0._checkpoint_wrapped_module.fc1.weight")
    'blocks.0.fc1.weight'
    >>> clean_name("_orig_mod.head.weight")
    'head.weight'
    """
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """`model.named_parameters()` with clean names (the first parameter of a name wins)."""
    seen: set[str] = set()
    named: list[tuple[str, nn.Parameter]] = []
    for name, param in model.named_parameters():
        clean = clean_name(name)
        if clean not in seen:
            seen.add(clean)
            named.append((clean, param))
    return named


def fsdp1_modules(model: nn.Module) -> list[nn.Module]:
    """Every FSDP1 `FullyShardedDataParallel` instance in `model` (outermost first)."""
    module = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    fsdp = getattr(module, "FullyShardedDataParallel", None)
    if not isinstance(fsdp, type):
        return []
    return [m for m in model.modules() if isinstance(m, fsdp)]


def sharding(model: nn.Module, params: Iterable[nn.Parameter]) -> str | None:
    """ "fsdp1", "fsdp2" (DTensor parameters, FSDP2's and tensor parallelism's) or None:
    whether a rank's gradients are only its shard of the whole."""
    if fsdp1_modules(model):
        return "fsdp1"
    if any(is_dtensor(p) for p in params):
        return "fsdp2"
    return None


def compute_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype a sharding wrapper's mixed-precision policy casts parameters to for
    forward and backward (FSDP1's `MixedPrecision.param_dtype`, FSDP2's
    `MixedPrecisionPolicy.param_dtype`), which the stored fp32 shards do not show; None
    without one. FSDP2 keeps its policy on private state: read defensively."""
    for module in model.modules():
        policy = getattr(module, "mixed_precision", None)  # FSDP1
        state = getattr(module, "_get_fsdp_state", None)  # FSDP2
        if policy is None and callable(state):
            try:
                policy = getattr(state(), "_mp_policy", None)
            except Exception:  # noqa: BLE001 - private API: no policy known, not an error
                policy = None
        dtype = getattr(policy, "param_dtype", None)
        if isinstance(dtype, torch.dtype):
            return dtype
    return None


def fsdp1_replicas(model: nn.Module) -> int | None:
    """On how many ranks each of this rank's FSDP1 gradient shards is held identically, so
    that its sum of squares counts 1/k toward the global norm (`local_sumsq`), read from the
    wrappers' process groups (their sizes: no collective):
    - FULL_SHARD, SHARD_GRAD_OP: 1 (disjoint shards);
    - NO_SHARD: the process group's size (every rank holds the whole all-reduced gradient);
    - HYBRID_SHARD, _HYBRID_SHARD_ZERO2: the replica group's size (`_inter_node_pg`: each
      shard group's shards are all-reduced across it).
    None where the parts cannot add up to one norm: wrapped modules that disagree; ignored
    parameters (FSDP1 never reduces their gradients, and its own `clip_grad_norm_` adds
    each rank's local norm of them unreduced, so the global norm differs from rank to rank
    and no rank knows the others' without a collective); a hybrid whose shard group is one
    rank (FSDP1 then runs it as NO_SHARD and, in torch 2.x, reduces nothing across the
    replicas: the ranks' gradients differ)."""
    found: set[int] = set()
    for module in fsdp1_modules(model):
        strategy = getattr(getattr(module, "sharding_strategy", None), "name", None)
        inter = _group_size(getattr(module, "_inter_node_pg", None))
        if getattr(module, "_ignored_params", None):
            return None
        if strategy in _DISJOINT_FSDP1:
            found.add(1)
        elif strategy == "NO_SHARD" and (inter or 1) == 1:
            found.add(_group_size(getattr(module, "process_group", None)) or 0)
        elif strategy in _HYBRID_FSDP1:
            found.add(inter or 0)
        else:
            return None
    return found.pop() if len(found) == 1 and 0 not in found else None


def _group_size(group: object) -> int | None:
    size = getattr(group, "size", None)
    try:
        return int(size()) if callable(size) else None
    except Exception:  # noqa: BLE001 - a group torch no longer holds: unknown, not an error
        return None


def _replicas(grad: torch.Tensor, plain: int | None) -> int | None:
    """On how many ranks `grad`'s local part is held identically: the sizes of the mesh
    dimensions a DTensor is Replicate on (1 when Shard on all); `plain` for a plain tensor;
    None when the local parts do not add up (Partial: unreduced sums)."""
    if not is_dtensor(grad):
        return plain
    mesh = grad.device_mesh  # type: ignore[attr-defined]
    replicas = 1
    for dim, placement in enumerate(grad.placements):  # type: ignore[attr-defined]
        kind = type(placement).__name__
        if kind == "Replicate":
            replicas *= int(mesh.size(dim))
        elif kind != "Shard" and kind != "_StridedShard":
            return None
    return replicas


def dtensor_replicas(params: Iterable[torch.Tensor]) -> int | None:
    """On how many ranks each DTensor parameter's local part is held (FSDP2's HSDP: the
    replicate dimension's size; 1 fully sharded), when all agree; else None.

    >>> dtensor_replicas([torch.ones(2)]) is None  # no DTensor
    True
    """
    found = {_replicas(p, None) for p in params if is_dtensor(p)}
    return found.pop() if len(found) == 1 and None not in found else None


def local_sumsq(
    params: Iterable[torch.Tensor], device: torch.device, *, plain: int | None
) -> torch.Tensor | None:
    """This rank's part of the global squared L2 norm of the parameters' gradients: the sum
    of squares of its local shards, each divided by the number of ranks holding it (so the
    parts of all ranks add up to the whole, `_replicas`), launched on the device without a
    host sync; `plain`: that number for plain gradients (None: they cannot be counted).
    None when some gradient's part cannot be counted exactly. A rank whose shards are
    empty adds 0. Non-finite gradients (an overflow step) give a non-finite part."""
    groups: dict[int, list[torch.Tensor]] = {}
    for param in params:
        grad = param.grad
        if grad is None or grad.is_sparse:
            continue
        replicas = _replicas(grad, plain)
        local = local_tensor(grad)
        if replicas is None or local is None:
            return None
        if local.numel():
            groups.setdefault(replicas, []).append(local.detach())
    total = torch.zeros((), dtype=torch.float32, device=device)
    for replicas, tensors in groups.items():
        norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
        squares = torch.stack([n.to(device) for n in norms]).square().sum()
        total = total + (squares if replicas == 1 else squares / replicas)
    return total


def has_flat_params(names: Iterable[str]) -> bool:
    """Whether FSDP1 flat parameters stand for the user's (`use_orig_params=False`)."""
    return any(name == FLAT_PARAM or name.endswith("." + FLAT_PARAM) for name in names)


def whole_scalar(value: torch.Tensor) -> torch.Tensor | None:
    """A one-element value every rank holds whole (the global norm a clip returned; a
    number given to `record()`), as a plain 0-d tensor, without a collective: FSDP2's clip
    returns a Replicate DTensor, whose local tensor is the global norm on every rank; a
    DTensor still Partial (or Shard) would need a collective, so None."""
    if is_dtensor(value):
        placements = getattr(value, "placements", ())
        if not all(type(p).__name__ == "Replicate" for p in placements):
            return None
    return scalar(value)


def tap_fsdp1_clip(
    root: nn.Module,
    before: Callable[[list[torch.Tensor]], None],
    after: Callable[[list[torch.Tensor], torch.Tensor, Any, Any], None],
) -> Callable[[], None]:
    """FSDP1 clips through its own method, `model.clip_grad_norm_(max_norm, norm_type)`, which
    all-reduces the shards' norms and returns the global norm: patch it on `root` so the
    handle sees the call (`before`, the clip checks) and its result (`after`), as the
    `torch.nn.utils.clip_grad_norm_` wrapper does. Returns the restore function."""

    def make(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def clip_grad_norm_(max_norm: Any, norm_type: Any = 2.0) -> torch.Tensor:
            params: list[torch.Tensor] = list(root.parameters())
            before(params)  # never raises (the handle's callbacks catch)
            total = original(max_norm, norm_type)
            after(params, total, max_norm, norm_type)
            return total

        return clip_grad_norm_

    return patch_method(root, "clip_grad_norm_", make)
