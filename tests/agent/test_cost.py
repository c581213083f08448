"""The cost rule: the agent adds no host sync to a training step.

Every tensor method that reads a value on the host (`.item()`, `.cpu()`, `.tolist()`,
`.numpy()`, `float()`, `int()`, `bool()`) is counted on the training thread while the same
loop runs bare and watched; the counts must be equal (GradScaler's own `.item()` in
`step()` is in both). The sender thread's reads are the point of it and are not counted.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from agent_fakes import FakeCollector
from torch import nn

from ampwatch.agent import watch

SYNCING = ("item", "cpu", "tolist", "numpy", "__float__", "__int__", "__bool__")


def _count_host_reads(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    counts: Counter[str] = Counter()
    training = threading.get_ident()
    for name in SYNCING:
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, _o: Callable = original, _n: str = name) -> Any:
            if threading.get_ident() == training:
                counts[_n] += 1
            return _o(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


def _loop(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any, steps: int) -> None:
    for step in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
            if step == 3:
                loss = loss * 1e30  # a skipped step takes the same path
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()


@pytest.mark.parametrize(
    ("optimizer_kind", "scaler_kwargs"),
    [
        ("adamw", {}),
        ("adamw_fused", {}),
        ("sgd", {"init_scale": 1000.0, "growth_factor": 3.0}),  # the direct-count path
        ("sgd", None),  # no scaler: the optimizer hooks
    ],
)
def test_no_host_sync_on_the_training_thread(
    optimizer_kind: str,
    scaler_kwargs: dict | None,
    monkeypatch: pytest.MonkeyPatch,
    collector: FakeCollector,
) -> None:
    def setup() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        if optimizer_kind == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        else:
            fused = optimizer_kind == "adamw_fused"
            optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), fused=fused)
        scaler = None if scaler_kwargs is None else torch.amp.GradScaler("cpu", **scaler_kwargs)
        return model, optimizer, scaler

    counts = _count_host_reads(monkeypatch)
    _loop(*setup(), steps=6)  # warm-up: first-call-only work in torch is in neither count
    objects = setup()
    counts.clear()  # the optimizer's constructor compares a tensor lr: not a step's work
    _loop(*objects, steps=6)
    bare = Counter(counts)

    model, optimizer, scaler = setup()
    handle = watch(model, optimizer, scaler, transport=collector, layer_stats_every=1)
    counts.clear()  # attach-time reads (the model summary) are not per step
    _loop(model, optimizer, scaler, steps=6)
    watched = Counter(counts)
    handle.detach()

    assert watched == bare
    assert len(collector.steps()) == 6 and len(collector.layer_stats()) == 6
