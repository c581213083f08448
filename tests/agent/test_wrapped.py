"""The loop shapes frameworks produce, on plain torch: wrapped objects unwrapped at attach
(an unsupported one is a TypeError that says what is supported, never an AttributeError
from inside the agent), `step(closure)`, losses divided by the accumulation steps or given
as numbers, the loop's own clip norm, autocast entered inside `forward`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from agent_fakes import FakeCollector
from torch import nn

from ampwatch.agent import watch


def test_an_unsupported_optimizer_is_a_type_error_naming_what_is_supported(
    collector: FakeCollector,
) -> None:
    class NotAnOptimizer:
        def step(self) -> None: ...

    with pytest.raises(TypeError, match="AcceleratedOptimizer") as error:
        watch(nn.Linear(2, 2), NotAnOptimizer(), transport=collector)  # type: ignore[arg-type]
    assert "NotAnOptimizer" in str(error.value)


def test_a_closure_step_is_measured_after_the_closure(collector: FakeCollector) -> None:
    """Lightning-style `step(closure)`: the closure runs backward, so the stored norm and
    loss are this step's, not the previous one's (a spike shows at its own step)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    handle = watch(model, optimizer, transport=collector, layer_stats_every=1)
    norms = []
    for step in range(1, 6):
        x = torch.randn(8, 4) * (1e3 if step == 3 else 1.0)

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            optimizer.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss

        # the grads before step() are the previous step's: a pre-step read would be wrong
        optimizer.step(closure)
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
    handle.detach()
    assert collector.column("grad_norm") == norms
    assert max(range(5), key=lambda i: collector.column("grad_norm")[i]) == 2
    assert all(v is not None for v in collector.column("loss"))  # the closure's loss
    assert collector.column("skipped") == [False] * 5


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_stored_loss_is_the_undivided_step_loss(
    reduction: str, collector: FakeCollector
) -> None:
    """Accumulation over 4 micro-batches: a loop that divides each loss by 4 before
    backward says `loss_reduction="sum"`; one that does not keeps the default mean. Either
    way the stored loss is the mean micro-batch loss, as the loop computed it."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    handle = watch(model, optimizer, scaler, transport=collector, loss_reduction=reduction)
    expected = []
    for _ in range(3):
        losses = []
        for _ in range(4):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            losses.append(loss.item())
            scaler.scale(loss / 4 if reduction == "sum" else loss).backward()
        expected.append(sum(losses) / 4)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    handle.detach()
    assert collector.column("loss") == pytest.approx(expected, rel=1e-6)


def test_log_loss_takes_numbers_and_wins_over_the_scaler(collector: FakeCollector) -> None:
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    handle = watch(model, optimizer, scaler, transport=collector)
    for value in (2.0, 3.0):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        handle.log_loss(value)  # a Python float: what the loop logged
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    handle.detach()
    assert collector.column("loss") == [2.0, 3.0]
    assert handle.counters["hook_errors"] == 0


def _clipping_loop(
    collector: FakeCollector, with_scaler: bool, clip: Callable[[Any], Any], inf_last: bool
) -> tuple[list[float], list[float], list[Any]]:
    """Five steps of a watched loop (a x1e4 spike at the 3rd; with `inf_last` an Inf
    gradient at the 5th, as an overflowing backward leaves it) clipped by `clip` after
    `unscale_`: torch's own norm just before and just after each clip, and what it returned."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if with_scaler else None
    handle = watch(model, optimizer, scaler, transport=collector, layer_stats_every=1)
    before, after, returned = [], [], []
    for step in range(5):
        loss = model(torch.randn(8, 4) * (1e4 if step == 2 else 1.0)).pow(2).mean()
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        if inf_last and step == 4:  # the last step: without a scaler its NaN update is applied
            assert model.weight.grad is not None
            model.weight.grad[0, 0] = float("inf")
        if scaler is not None:
            scaler.unscale_(optimizer)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        before.append(torch.nn.utils.get_total_norm(grads).item())
        returned.append(clip(model.parameters()))
        after.append(torch.nn.utils.get_total_norm(grads).item())
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
    handle.detach()
    return before, after, returned


def _two_step_clip(parameters: Any) -> torch.Tensor:
    """The clip as accelerate >= 1.16 (so the HF Trainer) and torchtitan write it: the norm,
    then the clip with that norm."""
    params = list(parameters)
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    torch.nn.utils.clip_grads_with_norm_(params, 4.0, total)
    return total


@pytest.mark.parametrize("two_step", [False, True], ids=["clip_grad_norm_", "two-step"])
@pytest.mark.parametrize("with_scaler", [True, False])
def test_the_grad_norm_is_the_one_the_loops_clip_returned(
    with_scaler: bool, two_step: bool, collector: FakeCollector
) -> None:
    """Read after clipping, a spike would be stored as the threshold. The norm after the
    clip is stored besides it: the norm of the gradients torch's own clip left, below the
    threshold (coefficient clamped at 1), above it, and on an overflowing step (an Inf
    gradient: the clip multiplies by 0 and leaves NaN, which the scaler's step skips).
    The same for the clip in two calls (`get_total_norm`, `clip_grads_with_norm_`)."""
    clip = _two_step_clip if two_step else lambda p: torch.nn.utils.clip_grad_norm_(p, 4.0)
    _, after, norms = _clipping_loop(collector, with_scaler, clip, True)
    returned = [norm.item() for norm in norms]
    assert collector.column("grad_norm") == returned
    assert returned[2] > 1e3  # the spike is stored as it was, not as the threshold
    clipped = collector.column("grad_norm_clipped")
    assert clipped[4] != clipped[4] and after[4] != after[4]  # NaN, as the clipped grads
    finite = [0, 1, 2, 3]
    assert [clipped[i] for i in finite] == pytest.approx([after[i] for i in finite], rel=1e-6)
    assert any(returned[i] < 4.0 and clipped[i] == returned[i] for i in finite)  # unclipped
    assert clipped[2] == pytest.approx(4.0, rel=1e-5)
    assert returned[4] == float("inf")
    assert collector.column("skipped") == [False] * 4 + [with_scaler]


@pytest.mark.parametrize("with_scaler", [True, False])
def test_clipping_by_value_stores_the_norm_before_the_clip(
    with_scaler: bool, collector: FakeCollector
) -> None:
    """`clip_grad_value_` returns nothing, and the norm read after it was the clipped one
    (a spike stored as ~ clip_value x sqrt(numel)). Truth: torch's own norm of the
    gradients just before and just after the loop's clip."""
    before, after, _ = _clipping_loop(
        collector, with_scaler, lambda p: torch.nn.utils.clip_grad_value_(p, 0.5), False
    )
    assert collector.column("grad_norm") == before
    assert collector.column("grad_norm_clipped") == after
    assert before[2] > 1e3 > after[2]  # the spike as it was, not as the clip left it


def test_autocast_entered_inside_forward_is_found(collector: FakeCollector) -> None:
    class SelfCasting(nn.Module):  # as accelerate and HF models do
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.head(self.body(x))

    model = SelfCasting()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    handle = watch(model, optimizer, transport=collector)
    model(torch.randn(2, 4)).float().sum().backward()
    optimizer.step()
    assert not model._forward_hooks and not model.body._forward_pre_hooks  # the probe left
    handle.detach()
    codes = [e["data"]["code"] for e in collector.events("finding")]
    assert codes == ["bf16_in_use"]


@pytest.mark.parametrize("with_scaler", [True, False])
def test_the_new_paths_add_no_host_sync(
    with_scaler: bool, monkeypatch: pytest.MonkeyPatch, collector: FakeCollector
) -> None:
    """The loop shapes above (closure step, the loop's clip, a logged tensor loss) read
    nothing on the training thread that the bare loop does not (see test_cost.py)."""
    from test_cost import _count_host_reads

    def setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler | None]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, optimizer, torch.amp.GradScaler("cpu") if with_scaler else None

    def loop(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any, log: Any) -> None:
        for _ in range(6):
            x = torch.randn(4, 8)
            if scaler is not None:
                loss = model(x).pow(2).mean()
                log(loss)
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
            else:

                def closure(x: torch.Tensor = x) -> torch.Tensor:
                    optimizer.zero_grad()
                    loss = model(x).pow(2).mean()
                    log(loss)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    return loss

                optimizer.step(closure)
            optimizer.zero_grad()

    counts = _count_host_reads(monkeypatch)
    loop(*setup(), log=lambda loss: None)  # warm-up
    objects = setup()
    counts.clear()
    loop(*objects, log=lambda loss: None)
    bare = Counter(counts)
    model, optimizer, scaler = setup()
    handle = watch(model, optimizer, scaler, transport=collector, layer_stats_every=2)
    counts.clear()
    loop(model, optimizer, scaler, log=handle.log_loss)
    watched = Counter(counts)
    handle.detach()
    assert watched == bare
    assert len(collector.steps()) == 6 and len(collector.layer_stats()) == 3
