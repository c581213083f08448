"""What the run is, sent once in `run_start`: model layout, scaler settings, process, precision."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
from torch import nn

from ampwatch.agent.shards import named_parameters


def model_summary(model: nn.Module) -> dict[str, Any]:
    """Parameters named as the user's model names them; a DTensor's shape is the whole
    tensor's, an FSDP1 flat parameter's this rank's shard."""
    params = named_parameters(model)
    return {
        "class": type(model).__qualname__,
        "num_params": sum(p.numel() for _, p in params),
        "params": [
            {"name": name, "shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
            for name, p in params
        ],
    }


def guess_precision(
    model: nn.Module, scaler_enabled: bool, compute: torch.dtype | None = None
) -> str:
    """A label for the recipe, from parameter dtypes, the dtype a sharding wrapper computes
    in (`compute`: FSDP's mixed-precision policy) and the scaler (autocast is not visible
    at attach time, so an fp32 model with a scaler is taken to be fp16 autocast)."""
    dtypes = {p.dtype for p in model.parameters()} | ({compute} if compute else set())
    if torch.float16 in dtypes:
        return "fp16" if scaler_enabled else "fp16 (no loss scaler)"
    if torch.bfloat16 in dtypes:
        return "bf16"
    if scaler_enabled:
        return "amp fp16 (autocast + GradScaler)"
    return "fp32 or bf16 autocast"


def params_of_dtype(
    model: nn.Module, dtypes: set[torch.dtype], *, buffers: bool = False
) -> list[str]:
    """Names of parameters (and with `buffers`, buffers: FP8 weights may be kept as
    either) stored in `dtypes`."""
    tensors = [*model.named_parameters(), *(model.named_buffers() if buffers else ())]
    return [name for name, t in tensors if t.dtype in dtypes]


FP16 = {torch.float16}
BF16 = {torch.bfloat16}
#: Every FP8 dtype this torch knows (the set has grown across releases).
FP8 = {
    dtype
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}


def optimizer_summary(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Class and per-group settings at attach (a tensor lr is named, not read: no sync)."""
    return {
        "class": type(optimizer).__qualname__,
        "fused": bool(optimizer.defaults.get("fused")),
        "param_groups": [
            {
                "params": len(group["params"]),
                "lr": "tensor" if isinstance(group.get("lr"), torch.Tensor) else group.get("lr"),
            }
            for group in optimizer.param_groups
        ],
    }


def process_info() -> dict[str, Any]:
    """Host, pid, torch version and distributed rank; world_size 1 / rank 0 when
    `torch.distributed` is not initialized (read at attach: initialize it first)."""
    dist = torch.distributed
    initialized = dist.is_available() and dist.is_initialized()
    return {
        "torch_version": torch.__version__,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "world_size": dist.get_world_size() if initialized else 1,
        "rank": dist.get_rank() if initialized else 0,
    }


def sends_steps(rank: int, *, every_rank: bool) -> bool:
    """The distributed default: rank 0 alone sends step scalars (after DDP's all-reduce every
    rank holds the same grads, scale and skip), while every rank sends its own layer
    statistics (sharded and pipeline-parallel ranks hold different parameters).

    >>> [sends_steps(r, every_rank=False) for r in (0, 1)], sends_steps(1, every_rank=True)
    ([True, False], True)
    """
    return every_rank or rank == 0
