"""Findings (precision in use, misuse) and the checkpoint helper."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from agent_fakes import FakeCollector
from torch import nn

from ampwatch.agent import watch


def _codes(collector: FakeCollector) -> list[str]:
    return [e["data"]["code"] for e in collector.events("finding")]


def test_bf16_parameters_are_found_at_attach(collector: FakeCollector) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to(torch.bfloat16))
    watch(model, torch.optim.SGD(model.parameters(), lr=0.1), transport=collector).detach()
    (finding,) = collector.events("finding")
    assert finding["data"]["code"] == "bf16_in_use"
    assert finding["data"]["params"] == ["1.weight", "1.bias"]
    assert finding["data"]["source"] == "parameters"


def test_fp8_buffers_are_found_at_attach(collector: FakeCollector) -> None:
    model = nn.Linear(2, 2)
    model.register_buffer("weight_fp8", torch.zeros(2, 2, dtype=torch.float8_e4m3fn))
    watch(model, torch.optim.SGD(model.parameters(), lr=0.1), transport=collector).detach()
    assert _codes(collector) == ["fp8_in_use"]


@pytest.mark.parametrize(
    ("dtype", "with_scaler", "codes"),
    [
        (torch.bfloat16, False, ["bf16_in_use"]),
        (torch.float16, False, ["fp16_params_without_scaler"]),
        (torch.float16, True, []),
    ],
)
def test_autocast_dtype_is_found_at_the_first_forward(
    dtype: torch.dtype, with_scaler: bool, codes: list[str], collector: FakeCollector
) -> None:
    model = nn.Linear(3, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu") if with_scaler else None
    handle = watch(model, optimizer, scaler, transport=collector)
    assert model._forward_hooks  # the probe
    for _ in range(2):
        with torch.autocast("cpu", dtype=dtype):
            model(torch.ones(1, 3)).float().sum().backward()
    assert not model._forward_hooks  # it removed itself after the first forward
    handle.detach()
    assert _codes(collector) == codes
    if codes:
        data = collector.events("finding")[0]["data"]
        assert data["source"] == "autocast" and data["dtype"] == str(dtype).removeprefix("torch.")


def test_fp8_modules_running_fp8_are_found_after_the_first_forward(
    collector: FakeCollector,
) -> None:
    class TELikeLinear(nn.Linear):  # Transformer Engine sets `fp8` inside its forward
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.fp8 = True
            return super().forward(x)

    model = nn.Sequential(TELikeLinear(2, 2))
    handle = watch(model, torch.optim.SGD(model.parameters(), lr=0.1), transport=collector)
    model(torch.ones(1, 2)).sum().backward()
    handle.detach()
    (finding,) = collector.events("finding")
    assert finding["data"]["code"] == "fp8_in_use" and finding["data"]["modules"] == ["0"]


def _amp_backward(model: nn.Module, scaler: torch.amp.GradScaler) -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(2, 4)).float().pow(2).mean()
    scaler.scale(loss).backward()


def test_clip_before_unscale_is_found_once_and_detach_restores_clip_grad_norm(
    collector: FakeCollector,
) -> None:
    original = torch.nn.utils.clip_grad_norm_
    original_in_module = torch.nn.utils.clip_grad.clip_grad_norm_
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    handle = watch(model, optimizer, scaler, transport=collector)
    assert torch.nn.utils.clip_grad_norm_ is not original

    # The right order: unscale_, then clip. No finding; the wrapper returns the norm.
    _amp_backward(model, scaler)
    scaler.unscale_(optimizer)
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    norm = torch.nn.utils.clip_grad_norm_((p for p in model.parameters()), 1e9)  # generator
    assert norm == expected
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    assert _codes(collector) == []

    for _ in range(2):  # the wrong order, twice: one finding
        _amp_backward(model, scaler)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    # Clipping parameters no watched optimizer holds is none of our business.
    torch.nn.utils.clip_grad_norm_(nn.Linear(2, 2).parameters(), max_norm=1.0)
    handle.detach()

    assert torch.nn.utils.clip_grad_norm_ is original
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is original_in_module
    (finding,) = collector.events("finding")
    assert finding["data"]["code"] == "clip_before_unscale"
    assert finding["data"]["at_step"] == 2 and finding["data"]["optimizers"] == ["SGD"]


def test_two_live_handles_share_one_clip_wrapper(collector: FakeCollector) -> None:
    original = torch.nn.utils.clip_grad_norm_
    handles = []
    for _ in range(2):
        model = nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        handles.append(watch(model, optimizer, torch.amp.GradScaler("cpu"), transport=collector))
    handles[0].detach()
    assert torch.nn.utils.clip_grad_norm_ is not original  # the second still checks
    handles[1].detach()
    assert torch.nn.utils.clip_grad_norm_ is original


def test_save_checkpoint_saves_and_reports(tmp_path: Path, collector: FakeCollector) -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = watch(model, optimizer, transport=collector)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    path = tmp_path / "step1.pt"
    handle.save_checkpoint({"model": model.state_dict()}, path)
    with pytest.raises(RuntimeError, match="does not exist"):  # torch.save's own error
        handle.save_checkpoint({}, tmp_path / "missing" / "dir" / "x.pt")
    handle.detach()
    assert torch.load(path)["model"]["weight"].equal(model.weight.detach())
    (event,) = collector.events("checkpoint")
    assert event["step"] == 1 and event["data"] == {"path": str(path)}


def test_a_disabled_agent_still_saves_checkpoints(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    handle = watch(model, torch.optim.SGD(model.parameters(), lr=0.1), enabled=False)
    handle.save_checkpoint(model.state_dict(), tmp_path / "x.pt")
    assert (tmp_path / "x.pt").exists()
