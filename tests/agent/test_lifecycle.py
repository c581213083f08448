"""Attach, detach and misuse: the agent leaves nothing behind and fails fast on bad input."""

from __future__ import annotations

import threading

import pytest
import torch
from agent_fakes import FakeCollector
from torch import nn

from ampwatch.agent import Lifecycle, watch


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _amp_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
) -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(3, 4)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()


def _assert_untouched(
    model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
) -> None:
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    if scaler is not None:
        assert "scale" not in scaler.__dict__ and "update" not in scaler.__dict__
        assert scaler.scale.__func__ is torch.amp.GradScaler.scale
        assert scaler.update.__func__ is torch.amp.GradScaler.update


@pytest.mark.parametrize("activations", [False, True])
@pytest.mark.parametrize("with_scaler", [True, False])
def test_detach_removes_every_hook_and_patch_and_is_idempotent(
    with_scaler: bool, activations: bool, collector: FakeCollector
) -> None:
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu") if with_scaler else None
    # Every step sampled: the activation hooks are armed again when detach() runs.
    handle = watch(
        model, optimizer, scaler, transport=collector, activation_max_abs=activations,
        layer_stats_every=1,
    )  # fmt: skip
    assert handle.state is Lifecycle.ATTACHED
    assert model[2]._forward_pre_hooks  # the head's input is the final hidden state
    assert all(bool(m._forward_hooks) is activations for m in model.children())  # every leaf module
    if scaler is not None:
        assert "update" in scaler.__dict__
        _amp_step(model, optimizer, scaler)
    else:
        optimizer.step()
    assert all(bool(m._forward_hooks) is activations for m in model.children())
    handle.detach()
    handle.detach()

    assert handle.state is Lifecycle.DETACHED
    _assert_untouched(model, optimizer, scaler)
    (end,) = collector.events("run_end")
    assert end["data"] == {"status": "finished", "reason": None} and end["step"] == 1
    # Recording after detach is a no-op, and the loop keeps working without the agent.
    handle.checkpoint("/ckpt/after.pt")
    handle.log_loss(torch.tensor(1.0))
    if scaler is not None:
        _amp_step(model, optimizer, scaler)
    assert handle.step == 1
    assert collector.events("checkpoint") == []


def test_context_manager_reports_failure_and_does_not_swallow_it(collector: FakeCollector) -> None:
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        pytest.raises(ValueError, match="boom"),
        watch(model, optimizer, transport=collector) as handle,
    ):
        handle.checkpoint("/ckpt/step0.pt", step=0)
        raise ValueError("boom")
    _assert_untouched(model, optimizer, None)
    (end,) = collector.events("run_end")
    assert end["data"]["status"] == "failed"
    assert end["data"]["reason"] == "ValueError('boom')"
    (checkpoint,) = collector.events("checkpoint")
    assert checkpoint["step"] == 0 and checkpoint["data"] == {"path": "/ckpt/step0.pt"}


def test_context_manager_finishes_cleanly(collector: FakeCollector) -> None:
    model = _mlp()
    with watch(model, torch.optim.SGD(model.parameters(), lr=0.1), transport=collector):
        pass
    assert [e["data"]["status"] for e in collector.events("run_end")] == ["finished"]


def test_watching_the_same_scaler_twice_is_an_error_until_detached(
    collector: FakeCollector,
) -> None:
    model, other = _mlp(), _mlp()
    scaler = torch.amp.GradScaler("cpu")
    first = watch(model, torch.optim.SGD(model.parameters(), lr=0.1), scaler, transport=collector)
    with pytest.raises(RuntimeError, match="already watched"):
        watch(other, torch.optim.SGD(other.parameters(), lr=0.1), scaler, transport=collector)
    first.detach()
    second = watch(other, torch.optim.SGD(other.parameters(), lr=0.1), scaler, transport=collector)
    second.detach()


def test_run_start_describes_the_run(collector: FakeCollector) -> None:
    model = _mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    handle = watch(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        scaler,
        run="r1",
        project="p",
        transport=collector,
    )
    handle.detach()
    batch = collector.batches[0]
    assert batch["run"] == {"client_run_id": handle.client_run_id, "name": "r1", "project": "p"}
    assert len(handle.client_run_id) == 32
    data = collector.events("run_start")[0]["data"]
    assert data["scaler"]["init_scale"] == 1024.0 and data["scaler"]["growth_interval"] == 7
    assert data["scaler"]["backoff_factor"] == 0.5
    assert data["precision"] == "amp fp16 (autocast + GradScaler)"
    assert (data["world_size"], data["rank"]) == (1, 0)
    assert data["final_layer"] == {"name": "2", "measures": "input"}
    assert data["model"]["params"][0] == {"name": "0.weight", "shape": [8, 4], "dtype": "float32"}
    assert data["torch_version"] == torch.__version__
    assert collector.events("finding") == []


def test_a_disabled_scaler_counts_as_no_scaler(collector: FakeCollector) -> None:
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    handle = watch(model, optimizer, scaler, transport=collector)
    assert "update" not in scaler.__dict__
    _amp_step(model, optimizer, scaler)
    handle.detach()
    (record,) = collector.steps()
    assert record["loss_scale"] is None and record["skipped"] is False


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_disabled_agent_is_a_true_no_op(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if how == "environment":
        monkeypatch.setenv("AMPWATCH_DISABLED", "1")
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    threads = threading.active_count()
    calls: list[bytes] = []
    with watch(
        model,
        optimizer,
        scaler,
        transport=lambda body, headers: calls.append(body) or 200,
        enabled=(how != "argument"),
    ) as handle:
        assert threading.active_count() == threads
        _assert_untouched(model, optimizer, scaler)
        _amp_step(model, optimizer, scaler)
        handle.checkpoint("/x.pt")
    assert handle.state is Lifecycle.DISABLED
    assert handle.step == 0 and calls == []
    assert handle.counters["batches_sent"] == 0 and set(handle.counters.values()) == {0}


def test_misuse_fails_fast_with_a_fix(collector: FakeCollector) -> None:
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    threads = threading.active_count()
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        watch(optimizer, optimizer)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        watch(model, model)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="GradScaler"):
        watch(model, optimizer, object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"final_layer='head'.*'0', '1', '2'"):
        watch(model, optimizer, final_layer="head", transport=collector)
    with pytest.raises(ValueError, match="layer_stats_every"):
        watch(model, optimizer, layer_stats_every=0, transport=collector)
    with pytest.raises(TypeError, match="transport"):
        watch(model, optimizer, transport="http://x")  # type: ignore[arg-type]
    _assert_untouched(model, optimizer, None)
    assert threading.active_count() == threads


def test_an_agent_failure_is_logged_once_counted_and_contained(
    collector: FakeCollector, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("agent bug")

    monkeypatch.setattr("ampwatch.agent.sampling.gradient_range", broken)
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    handle = watch(model, optimizer, scaler, transport=collector, layer_stats_every=1)
    for _ in range(3):
        _amp_step(model, optimizer, scaler)
    handle.detach()

    assert handle.counters["hook_errors"] == 3
    assert [r.message for r in caplog.records].count(
        "ampwatch agent hook failed; training continues"
    ) == 1
    assert [r["step"] for r in collector.steps()] == [1, 2, 3]  # steps survive
    assert collector.layer_stats() == []


def test_user_misuse_of_the_scaler_still_raises_torchs_own_error(collector: FakeCollector) -> None:
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    handle = watch(model, optimizer, scaler, transport=collector)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(3, 4)).float().sum()
    scaler.scale(loss).backward()
    with pytest.raises(AssertionError, match="No inf checks"):
        scaler.update()  # update() without step()
    assert handle.step == 0 and handle.counters["hook_errors"] == 0
    handle.detach()
    assert collector.steps() == []
