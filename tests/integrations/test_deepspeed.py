"""DeepSpeed 0.19 on the CPU (`DS_ACCELERATOR=cpu`, one gloo process) against a live
collector: `watch(engine)` compared step by step with the engine's own ground truth: its
loss scale and lr before each boundary step, `was_step_applied()` and `skipped_steps`, the
torch optimizer's step counter inside it (it does not move on a skip), the norm
`get_global_grad_norm()` reports, and the gradients `safe_get_full_grad` returns.

DeepSpeed's CPU accelerator reports no FP16 support (`is_fp16_supported()` is False, and
`initialize()` refuses an fp16 config), although torch runs FP16 math on the CPU: the FP16
cases set `is_fp16_supported` to return True, which is what a GPU accelerator answers.
Overflows: a micro-batch's FP16 loss times 1e6 overflows FP16 itself; under BF16 (no loss
scale) a loss times Inf makes the gradients non-finite, and the engine skips that step.
"""

from __future__ import annotations

import os
import socket

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")

import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_grad
from framework_truth import Truth, assert_matches, stored_run
from torch import nn

from ampwatch.integrations.deepspeed import watch

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),  # torch.distributed deprecations
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]
EVERY = 7

CASES = {
    # name: (ZeRO stage, precision, fused AdamW, accumulation, optimizer steps)
    "ds-z0-fp16-acc1": (0, "fp16", False, 1, 120),
    "ds-z1-fp16-fused-acc4": (1, "fp16", True, 4, 40),
    "ds-z2-bf16-acc4": (2, "bf16", False, 4, 40),
    "ds-z3-fp16-acc1": (3, "fp16", False, 1, 80),
    "ds-z1-bf16-acc1": (1, "bf16", False, 1, 80),
}


@pytest.fixture(scope="module")
def process_group():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # One gloo process: DeepSpeed's shared-memory all-reduce op has no peer to share
    # memory with, and compiling it (on a fresh machine, at the first init) took ~35 s.
    compatible = deepspeed.ops.__compatible_ops__
    shm = compatible.get("deepspeed_shm_comm")
    compatible["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    accelerator = get_accelerator()
    accelerator.is_fp16_supported = lambda: True  # see the module docstring
    yield
    del accelerator.is_fp16_supported
    torch.distributed.destroy_process_group()
    compatible["deepspeed_shm_comm"] = shm
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _full_grads(engine, stage: int) -> dict[str, torch.Tensor]:
    named = engine.module.named_parameters()
    if stage == 0:
        return {n: p.grad for n, p in named if p.grad is not None}
    return {n: g for n, p in named if (g := safe_get_full_grad(p)) is not None}


@pytest.mark.parametrize("case", list(CASES))
def test_deepspeed_engine_is_stored_exactly(case: str, process_group, live_collector) -> None:
    stage, precision, fused, accumulation, steps = CASES[case]
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.01 * s))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 1.0,
        precision: {"enabled": True},
    }
    if precision == "fp16":
        config["fp16"].update({"loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2,
                               "min_loss_scale": 2})  # fmt: skip
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=schedule, config=config
    )
    handle = watch(
        engine, run=case, url=live_collector.url, layer_stats_every=EVERY, flush_interval=0.05
    )
    dtype = next(engine.module.parameters()).dtype
    spikes = {3, 30, 31, 32, steps * accumulation - 5}
    factor = 1e6 if precision == "fp16" else float("inf")
    truth, micro, counters, applied = Truth(), [], [], []

    def counter() -> int:
        states = list(engine.optimizer.optimizer.state.values())
        return int(states[0]["step"]) if states and "step" in states[0] else 0

    for index in range(steps * accumulation):
        x, y = torch.randn(8, 16).to(dtype), torch.randn(8, 4).to(dtype)
        loss = F.mse_loss(engine(x), y)
        if index in spikes:
            loss = loss * factor
        micro.append(loss.float().item())
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary:
            truth.loss_scale.append(float(engine.optimizer.loss_scale))
            truth.lr.append(engine.get_lr()[0])
            truth.loss.append(sum(micro) / len(micro))
            micro.clear()
            step = len(truth.lr)
            if (step - 1) % EVERY == 0:
                truth.zero_fraction[step] = {
                    n: (g == 0).double().mean().item()
                    for n, g in _full_grads(engine, stage).items()
                }
            counters.append(counter())
        skipped_before = engine.skipped_steps
        engine.step()
        if boundary:
            truth.grad_norm.append(float(engine.get_global_grad_norm()))
            applied.append(engine.was_step_applied())
            assert engine.skipped_steps - skipped_before == (not applied[-1])
    handle.detach()

    after = [*counters[1:], counter()]
    truth.skipped = [a == b for b, a in zip(counters, after)]
    assert truth.skipped == [not a for a in applied]  # the step counter and the engine agree
    assert len(truth.skipped) == steps == engine.global_steps
    assert sum(truth.skipped) >= 2, "overflows were not forced"
    stored = stored_run(live_collector.url, case)
    assert_matches(stored, truth)
    # The scaler's configured floor reaches the run_start (BF16 has no scaler).
    (start,) = [e for e in stored["events"] if e["kind"] == "run_start"]
    assert start["data"]["min_loss_scale"] == (2.0 if precision == "fp16" else None)


def test_the_manual_api_example_records_one_step_per_boundary(process_group, live_collector):
    """`ampwatch.agent.manual`'s DeepSpeed example, as written there, with accumulation 4:
    one record per optimizer step and exactly the engine's skips (it used to record every
    micro-batch and count the non-boundary ones as skipped)."""
    from ampwatch.agent import watch as agent_watch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 4,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=config
    )
    handle = agent_watch(engine.module, run="manual", url=live_collector.url)
    skips = []
    for index in range(100):
        loss = F.mse_loss(engine(torch.randn(8, 16).half()), torch.randn(8, 4).half())
        if index in (10, 50):
            loss = loss * 1e6
        engine.backward(loss)
        handle.log_loss(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        scale, lr = engine.optimizer.loss_scale, engine.get_lr()[0]
        engine.step()
        if boundary:
            handle.record(
                loss_scale=scale,
                lr=lr,
                skipped=not engine.was_step_applied(),
                grad_norm=engine.get_global_grad_norm(),
            )
            skips.append(not engine.was_step_applied())
    handle.detach()
    steps = stored_run(live_collector.url, "manual")["steps"]
    assert steps["step"] == list(range(1, 26)) and engine.global_steps == 25
    assert steps["skipped"] == skips and sum(skips) == engine.skipped_steps == 2
