"""Exactness of every per-step and per-layer signal against ground truth read in the loop.

Real FP16 math on CPU: autocast float16 plus a CPU GradScaler, with overflows forced on
chosen steps, so skips, backoffs and growths all happen.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from agent_fakes import FakeCollector
from torch import nn

from ampwatch.agent import watch, wire

OVERFLOW_STEPS = {7, 19, 20, 33}
STEPS = 40
EVERY = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(2, 2)  # never gets a gradient: must be left out of layer stats
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=(kind == "adamw_fused"))


def _train_and_record_truth(kind: str, collector: FakeCollector) -> dict[str, list]:
    torch.manual_seed(0)
    model = Net()
    optimizer = _make_optimizer(kind, model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
    handle = watch(
        model, optimizer, scaler, transport=collector, layer_stats_every=EVERY, flush_interval=0.05
    )
    truth: dict[str, list] = {
        "skipped": [],
        "scale": [],
        "loss": [],
        "zero": [],
        "act": [],
        "norm": [],
        "grads": [],
    }
    for step in range(1, STEPS + 1):
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
            if step in OVERFLOW_STEPS:
                loss = loss * 1e30  # scaled grads overflow FP16 -> inf -> skipped step
        scaler.scale(loss).backward()
        with torch.no_grad():  # an evaluation forward: must not move the activation norm
            model(torch.randn(8, 16) * 100)
            with torch.autocast("cpu", dtype=torch.float16):
                norms = torch.linalg.vector_norm(model.body(x).float(), dim=-1)
        truth["act"].append((norms.mean().item(), norms.max().item()))
        truth["loss"].append(loss.item())
        scaler.step(optimizer)
        found = scaler._found_inf_per_device(optimizer)
        truth["skipped"].append(sum(v.item() for v in found.values()) > 0)
        truth["scale"].append(scaler.get_scale())
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        truth["norm"].append(torch.nn.utils.get_total_norm(list(grads.values())).item())
        if (step - 1) % EVERY == 0:
            truth["grads"].append((grads, scaler.get_scale()))
        scaler.update()
        if (step - 1) % EVERY == 0:
            truth["zero"].append(
                {
                    name: (p.grad == 0).float().mean().item()
                    for name, p in model.named_parameters()
                    if p.grad is not None
                }
            )
        optimizer.zero_grad()
    assert handle.step == STEPS
    handle.detach()
    return truth


@pytest.mark.parametrize("kind", ["sgd", "adamw", "adamw_fused"])
def test_step_signals_equal_ground_truth(kind: str, collector: FakeCollector) -> None:
    truth = _train_and_record_truth(kind, collector)

    assert collector.column("step") == list(range(1, STEPS + 1))
    assert collector.column("skipped") == truth["skipped"]
    assert collector.column("loss_scale") == truth["scale"]
    # The run must exercise what it claims to: forced skips, backoffs and growths.
    assert all(truth["skipped"][s - 1] for s in OVERFLOW_STEPS)
    assert not all(truth["skipped"])
    assert any(b > a for a, b in zip(truth["scale"], truth["scale"][1:], strict=False))
    assert collector.column("loss") == pytest.approx(truth["loss"], rel=1e-6)
    assert collector.column("lr") == [optimizer_lr(kind)] * STEPS
    act_mean, act_max = collector.column("act_norm_mean"), collector.column("act_norm_max")
    assert act_mean == pytest.approx([m for m, _ in truth["act"]], rel=1e-5)
    assert act_max == pytest.approx([m for _, m in truth["act"]], rel=1e-5)
    # The unscaled global norm, exactly as clip_grad_norm_ computes it (inf/NaN on skips).
    encoded = [wire.encode_float(v) for v in collector.column("grad_norm")]
    assert encoded == [wire.encode_float(v) for v in truth["norm"]]
    assert any(math.isfinite(v) and v > 0 for v in truth["norm"])


def optimizer_lr(kind: str) -> float:
    return 0.05 if kind == "sgd" else 1e-3


def test_zero_fractions_equal_ground_truth(collector: FakeCollector) -> None:
    truth = _train_and_record_truth("sgd", collector)

    records = collector.layer_stats()
    assert [r["step"] for r in records] == list(range(1, STEPS + 1, EVERY))
    for record, expected in zip(records, truth["zero"], strict=True):
        assert record["names"] == list(expected)  # grad-less `unused.*` is left out
        assert "unused.weight" not in record["names"]
        assert record["stats"]["zero_fraction"] == pytest.approx(list(expected.values()), abs=1e-7)
    # Dead ReLU units leave whole rows of zeros: the values are not trivially 0.
    assert any(0 < v < 1 for r in records for v in r["stats"]["zero_fraction"])


def test_micro_batches_average_loss_and_activation_norm(collector: FakeCollector) -> None:
    torch.manual_seed(1)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    handle = watch(model, optimizer, scaler, transport=collector)
    losses, means, maxes = [], [], []
    for _ in range(2):
        x = torch.randn(4, 16) * (len(losses) + 1)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
            norms = torch.linalg.vector_norm(model.body(x).detach().float(), dim=-1)
        scaler.scale(loss / 2).backward()
        losses.append(loss.item() / 2)
        means.append(norms.mean().item())
        maxes.append(norms.max().item())
    scaler.step(optimizer)
    scaler.update()
    handle.detach()

    (record,) = collector.steps()
    assert record["loss"] == pytest.approx(sum(losses) / 2, rel=1e-6)
    assert record["act_norm_mean"] == pytest.approx(sum(means) / 2, rel=1e-5)
    assert record["act_norm_max"] == pytest.approx(max(maxes), rel=1e-5)


def test_final_layer_override_measures_that_modules_output(collector: FakeCollector) -> None:
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    handle = watch(model, optimizer, transport=collector, final_layer="body.2")
    x = torch.randn(5, 16)
    with torch.no_grad():
        expected = torch.linalg.vector_norm(model.body[:3](x), dim=-1)
    model(x).sum().backward()
    optimizer.step()
    handle.detach()

    (record,) = collector.steps()
    assert record["act_norm_max"] == pytest.approx(expected.max().item(), rel=1e-5)
    start = collector.events("run_start")[0]["data"]
    assert start["final_layer"] == {"name": "body.2", "measures": "output"}


def test_without_scaler_loss_scale_is_null_and_loss_comes_from_log_loss(
    collector: FakeCollector,
) -> None:
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    handle = watch(model, optimizer, transport=collector)
    x = torch.randn(5, 16)
    logged_losses = []
    for logged in (True, False):
        loss = model(x).pow(2).mean()
        loss.backward()
        if logged:
            handle.log_loss(loss)
            logged_losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    handle.detach()

    first, second = collector.steps()
    assert first["loss"] == pytest.approx(logged_losses[0], rel=1e-6)
    assert second["loss"] is None
    assert [first["loss_scale"], second["loss_scale"]] == [None, None]
    assert [first["skipped"], second["skipped"]] == [False, False]
    assert [r["step"] for r in collector.layer_stats()] == [1]


def test_non_finite_loss_round_trips_as_wire_string(collector: FakeCollector) -> None:
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    handle = watch(model, optimizer, scaler, transport=collector)
    loss = model(torch.full((2, 3), math.inf)).sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    handle.detach()

    (record,) = collector.steps()
    assert record["loss"] in ("NaN", "Infinity", "-Infinity")
    assert record["skipped"] is True


def test_a_tensor_learning_rate_is_reported(collector: FakeCollector) -> None:
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.25))
    handle = watch(model, optimizer, transport=collector)
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    handle.detach()
    assert collector.column("lr") == [0.25]


def _direct_range(grad: torch.Tensor, scale: float) -> dict[str, object]:
    """Every range statistic computed straight from one gradient tensor, as the wire defines
    it: |g·S| in exact (float64) arithmetic, the max as float32 computes g*S."""
    scaled = (grad.double() * scale).abs()
    n = grad.numel()
    fields = (grad.float().view(torch.int32) >> 23) & 0xFF
    hist = torch.bincount(fields.flatten().long(), minlength=256).tolist()
    nonzero = [i for i, c in enumerate(hist) if c]
    return {
        "zero_fraction": int((grad == 0).sum()) / n,
        "flush_fraction": int(((scaled < 2.0**-24) & (grad != 0)).sum()) / n,
        "subnormal_fraction": int(((scaled >= 2.0**-24) & (scaled < 2.0**-14)).sum()) / n,
        "max_abs_scaled": wire.encode_float(
            (grad.float() * torch.tensor(scale, dtype=torch.float32)).abs().max().item()
        ),
        "offset": nonzero[0],
        "counts": hist[nonzero[0] : nonzero[-1] + 1],
    }


def _assert_record_matches(record: dict, grads: dict[str, torch.Tensor], scale: float) -> None:
    assert record["names"] == list(grads)
    spans = record["exponent_histograms"]
    for i, (name, grad) in enumerate(grads.items()):
        expected = _direct_range(grad, scale)
        got = {stat: record["stats"][stat][i] for stat in wire.LAYER_STATS}
        got["offset"], got["counts"] = spans["offsets"][i], spans["counts"][i]
        assert got == expected, name


def test_gradient_range_equals_direct_computation_in_fp16_training(
    collector: FakeCollector,
) -> None:
    truth = _train_and_record_truth("sgd", collector)

    records = collector.layer_stats()
    assert len(records) == len(truth["grads"])
    for record, (grads, scale) in zip(records, truth["grads"], strict=True):
        _assert_record_matches(record, grads, scale)
    # Step 33 is sampled and overflowed: Inf/NaN grads sit in field 255, in no fraction.
    overflowed = records[[r["step"] for r in records].index(33)]
    assert any(
        offset + len(c) == 256
        for offset, c in zip(
            overflowed["exponent_histograms"]["offsets"],
            overflowed["exponent_histograms"]["counts"],
            strict=True,
        )
    )


def _wide_range_run(collector: FakeCollector, scaler: torch.amp.GradScaler) -> list[tuple]:
    """FP32 grads spanning 1e-44..1e2 (float32 subnormals included): every range statistic
    is non-trivial at a small scale."""
    torch.manual_seed(3)
    model = nn.Linear(64, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    handle = watch(model, optimizer, scaler, transport=collector, layer_stats_every=1)
    magnitudes = 10.0 ** torch.linspace(-44, 2, 64)
    truth = []
    for _ in range(3):
        loss = (model(torch.randn(4, 64) * magnitudes) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        truth.append((grads, scaler.get_scale()))
        scaler.update()
        optimizer.zero_grad()
    handle.detach()
    return truth


@pytest.mark.parametrize(
    "scaler_args",
    [
        {"init_scale": 8.0},  # a power of two: derived from the histogram, shifted
        {"init_scale": 1000.0, "growth_factor": 3.0, "growth_interval": 1},  # counted directly
    ],
)
def test_gradient_range_is_exact_for_any_scale(scaler_args: dict, collector: FakeCollector) -> None:
    truth = _wide_range_run(collector, torch.amp.GradScaler("cpu", **scaler_args))

    records = collector.layer_stats()
    for record, (grads, scale) in zip(records, truth, strict=True):
        _assert_record_matches(record, grads, scale)
    stats = records[0]["stats"]
    assert 0 < stats["flush_fraction"][0] < 1 and 0 < stats["subnormal_fraction"][0] < 1
    assert records[0]["exponent_histograms"]["offsets"][0] == 0  # float32 subnormals/zeros


def test_the_norm_before_the_final_norm_is_measured_besides_the_one_after_it(
    collector: FakeCollector,
) -> None:
    """The demo model (pre-norm blocks, a final LayerNorm, a head): act_norm_* is the head's
    input, after the final norm; act_prenorm_* is that norm's input, the residual stream
    the last block returns, exactly as a direct forward computes them."""
    from ampwatch.server.demo import VOCAB, tiny_lm

    model = tiny_lm(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    handle = watch(model, optimizer, transport=collector)
    tokens = torch.randint(0, VOCAB, (4, 8))
    captured: dict[str, torch.Tensor] = {}
    model.norm.register_forward_hook(lambda m, args, out: captured.update(pre=args[0], post=out))
    loss = model(tokens).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    handle.detach()

    (record,) = collector.steps()
    pre = torch.linalg.vector_norm(captured["pre"].detach(), dim=-1)
    post = torch.linalg.vector_norm(captured["post"].detach(), dim=-1)
    assert record["act_prenorm_mean"] == pytest.approx(pre.mean().item(), rel=1e-5)
    assert record["act_prenorm_max"] == pytest.approx(pre.max().item(), rel=1e-5)
    assert record["act_norm_mean"] == pytest.approx(post.mean().item(), rel=1e-5)
    assert record["act_prenorm_mean"] != pytest.approx(record["act_norm_mean"], rel=0.05)


def test_no_final_norm_no_prenorm_field(collector: FakeCollector) -> None:
    model = Net()  # no LayerNorm: the head's input is already the last block's output
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    handle = watch(model, optimizer, transport=collector)
    model(torch.randn(4, 16)).pow(2).mean().backward()
    optimizer.step()
    handle.detach()
    (record,) = collector.steps()
    assert "act_prenorm_mean" not in record and record["act_norm_mean"] is not None
