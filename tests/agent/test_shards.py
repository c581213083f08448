"""Odd tensors never stop the agent: unknown subclasses are skipped and said once,
ShardedGradScaler's (1,)-shaped flags stack with 0-d values, a record the sender cannot
build costs that record, and wrapper segments leave parameter names. (The 2-process FSDP
and DTensor runs: tests/integrations/test_sharded.py.)"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from agent_fakes import FakeClock, FakeCollector, step_sample
from torch import nn

from ampwatch.agent import shards, wire
from ampwatch.agent.manual import manual_sample
from ampwatch.agent.records import StepSample
from ampwatch.agent.scaler import found_inf_total
from ampwatch.agent.stats import named_grads
from ampwatch.agent.transport import Sender

RUN: wire.RunRef = {"client_run_id": "c0ffee", "name": "t", "project": "default"}


class OddTensor(torch.Tensor):
    """A tensor subclass the agent does not know; `.tolist()` fails as a DTensor's may."""

    def tolist(self) -> Any:
        raise RuntimeError("a collective on one rank")


def test_names_lose_wrapper_segments_only() -> None:
    assert (
        shards.clean_name("_fsdp_wrapped_module.blocks.0._checkpoint_wrapped_module.fc.weight")
        == "blocks.0.fc.weight"
    )
    assert shards.clean_name("_orig_mod.module_list.0.bias") == "module_list.0.bias"
    assert shards.has_flat_params(["_flat_param", "blocks.0._flat_param"])
    assert not shards.has_flat_params(["blocks.0.fc.weight"])


def test_an_unknown_subclass_is_skipped_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    model(torch.randn(4, 3)).sum().backward()
    model[0].weight.grad = model[0].weight.grad.as_subclass(OddTensor)
    with caplog.at_level(logging.WARNING, logger="ampwatch.agent"):
        for _ in range(3):
            grads = named_grads(model.named_parameters())
    assert grads.names == ["0.bias", "1.weight", "1.bias"]  # the odd one left out
    assert grads.present == 4  # yet it had a gradient: a clip over all four covers it
    assert [type(t) for t in grads.tensors] == [torch.Tensor] * 3
    warned = [r for r in caplog.records if "OddTensor" in r.getMessage()]
    assert len(warned) == 1


def test_sharded_scaler_flags_of_shape_1_sum_with_0d_ones() -> None:
    scaler = SimpleNamespace(
        _per_optimizer_states={
            1: {"found_inf_per_device": {"cpu": torch.ones(1)}},  # ShardedGradScaler's
            2: {"found_inf_per_device": {"cpu": torch.tensor(0.0)}},  # GradScaler's
        }
    )
    total = found_inf_total(scaler, torch.device("cpu"))  # type: ignore[arg-type]
    assert total is not None and total.shape == () and float(total) == 1.0
    assert shards.scalar(torch.ones(1)).shape == ()  # type: ignore[union-attr]
    assert shards.scalar(torch.ones(2)) is None


def test_record_refuses_a_tensor_that_is_not_one_plain_value() -> None:
    sample = manual_sample(1, 0, {"loss": torch.ones(1), "grad_norm": 2.0}, lambda t: (t, None))
    assert sample.fields == ("loss",) and sample.host == {"grad_norm": 2.0}
    with pytest.raises(TypeError, match="one-element"):
        manual_sample(1, 0, {"loss": torch.ones(3)}, lambda t: (t, None))


def test_a_record_the_sender_cannot_build_is_dropped_and_the_sender_goes_on() -> None:
    clock = FakeClock()
    collector = FakeCollector()
    sender = Sender(RUN, collector, flush_interval=0.01, delivery=clock.options())
    odd = torch.tensor([5.0]).as_subclass(OddTensor)
    sender.put(StepSample(1, 0, ("loss",), odd, None))
    sender.put(step_sample(2))
    clock.sleep(0.01)
    sender.tick()
    sender.put(step_sample(3))
    assert sender.close(timeout=5)
    assert [r["step"] for r in collector.steps()] == [2, 3]
    assert sender.counters()["dropped_steps"] == 1


def test_local_sumsq_counts_each_gradient_once_over_its_holders() -> None:
    """A rank's part of the squared global norm: its shards' squares, a gradient that
    `plain` ranks hold whole divided among them; non-finite stays non-finite; a part that
    cannot be counted is None (the agent then says so and stores no norm)."""
    params = [
        nn.Parameter(torch.zeros(3)),
        nn.Parameter(torch.zeros(2, 2)),
        nn.Parameter(torch.zeros(1)),
    ]
    params[0].grad = torch.tensor([1.0, 2.0, 2.0])
    params[1].grad = torch.tensor([[3.0, 0.0], [0.0, 4.0]])  # params[2] has no gradient
    cpu = torch.device("cpu")
    part = shards.local_sumsq(params, cpu, plain=1)
    assert part is not None and part.item() == 9.0 + 25.0
    halves = shards.local_sumsq(params, cpu, plain=2)
    assert halves is not None and halves.item() == 17.0
    assert shards.local_sumsq(params, cpu, plain=None) is None
    params[1].grad[0, 0] = float("inf")
    overflow = shards.local_sumsq(params, cpu, plain=1)
    assert overflow is not None and overflow.item() == float("inf")
    empty = [nn.Parameter(torch.zeros(0))]
    empty[0].grad = torch.zeros(0)  # a rank whose shard of every gradient is empty
    nothing = shards.local_sumsq(empty, cpu, plain=1)
    assert nothing is not None and nothing.item() == 0.0
