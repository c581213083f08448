"""What the run is, sent once in `run_start`: model layout, scaler settings, process, precision."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
from torch import nn


def model_summary(model: nn.Module) -> dict[str, Any]:
    params = list(model.named_parameters())
    return {
        "class": type(model).__qualname__,
        "num_params": sum(p.numel() for _, p in params),
        "params": [
            {"name": name, "shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
            for name, p in params
        ],
    }


def guess_precision(model: nn.Module, scaler_enabled: bool) -> str:
    """A label for the recipe, from parameter dtypes and the scaler (autocast is not visible
    at attach time, so an fp32 model with a scaler is taken to be fp16 autocast)."""
    dtypes = {p.dtype for p in model.parameters()}
    if torch.float16 in dtypes:
        return "fp16" if scaler_enabled else "fp16 (no loss scaler)"
    if torch.bfloat16 in dtypes:
        return "bf16"
    if scaler_enabled:
        return "amp fp16 (autocast + GradScaler)"
    return "fp32 or bf16 autocast"


def fp16_params(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.dtype == torch.float16]


def process_info() -> dict[str, Any]:
    """Host, pid and distributed rank; world_size 1 / rank 0 when not initialized."""
    dist = torch.distributed
    initialized = dist.is_available() and dist.is_initialized()
    return {
        "torch_version": torch.__version__,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "world_size": dist.get_world_size() if initialized else 1,
        "rank": dist.get_rank() if initialized else 0,
    }
