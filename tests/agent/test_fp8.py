"""FP8 readiness: every share equals a direct computation with torch's own float8 casts,
group by group (tile and block edges, all-zero groups, NaN/Inf, sizes that are not a
multiple of the group); the one-read implementation gives what the straightforward one
(kept here) gives, on random and adversarial tensors; the agent sends it from a real FP16
autocast loop, a CPU tensor's statistics computed on the sender thread from a copy."""

from __future__ import annotations

import math

import pytest
import torch
from agent_fakes import FakeCollector
from torch import nn

from ampwatch.agent import fp8, watch, wire
from ampwatch.agent.fp8 import Fp8Monitor, check_options
from ampwatch.agent.fp8_counts import (
    FORMATS,
    VALUES_PER_TENSOR,
    Workspace,
    quantisation_counts,
    shares,
)

GROUP = {"tile": (1, 128), "block": (128, 128), "mx": (1, 32)}


def _groups(rows: int, cols: int, scaling: str) -> list[tuple[slice, slice]]:
    if scaling == "tensor":
        return [(slice(0, rows), slice(0, cols))]
    height, width = GROUP[scaling]
    return [
        (slice(r, min(r + height, rows)), slice(c, min(c + width, cols)))
        for r in range(0, rows, height)
        for c in range(0, cols, width)
    ]


def direct(x: torch.Tensor, fmt: str, scaling: str) -> dict[str, float]:
    """The reference: per group, its scale, then torch's saturating float8 cast of the
    signed values; shares over all elements, error in float64."""
    dtype, fmax, _ = FORMATS[fmt]
    x2 = x.float().reshape(1, -1) if x.dim() < 2 else x.float().reshape(-1, x.shape[-1])
    clean = torch.where(torch.isfinite(x2), x2, torch.zeros_like(x2))
    flush = saturate = 0
    err_sq = 0.0
    amaxes = []
    for rows, cols in _groups(*clean.shape, scaling):
        group = clean[rows, cols]
        amax = group.abs().max()
        amaxes.append(amax.item())
        if amax.item() == 0:
            scale = torch.tensor(1.0)
        elif scaling == "mx":  # the smallest power of two 2^e with amax <= fmax * 2^e
            e = math.ceil(math.log2(amax.item() / fmax))
            e += amax.item() > fmax * 2.0**e
            e -= amax.item() <= fmax * 2.0 ** (e - 1)
            scale = torch.tensor(2.0 ** -min(max(e, -127), 127))
        else:
            scale = torch.clamp(torch.tensor(fmax) / amax, max=torch.finfo(torch.float32).max)
        y = group * scale
        q = y.clamp(-fmax, fmax).to(dtype).float()
        flush += int(((q == 0) & (group != 0)).sum())
        if fmt == "e5m2":  # the plain cast overflows to Inf exactly where it saturates
            saturate += int(torch.isinf(y.to(dtype).float()).sum())
        else:  # torch's CPU E4M3 cast saturates by itself: the tie 464 rounds to 448
            saturate += int((y.abs() > 464.0).sum())
        err_sq += float(((q.double() / scale.double() - group.double()) ** 2).sum())
    norm_sq = float((clean.double() ** 2).sum())
    positive = [a for a in amaxes if a > 0]
    spread = math.log2(max(positive) / min(positive)) if positive else 0.0
    return {
        "flush": flush / x.numel(),
        "saturate": saturate / x.numel(),
        "error": math.sqrt(err_sq / norm_sq) if norm_sq else 0.0,
        "spread": spread,
    }


def _wide(*shape: int, seed: int = 0) -> torch.Tensor:
    """Gaussian values over ~40 binary orders of magnitude: every group flushes some,
    MX groups saturate some."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=generator)
    return x * torch.exp2(torch.randint(-30, 10, shape, generator=generator).float())


def _cases() -> dict[str, torch.Tensor]:
    edges = _wide(130, 257, seed=1)  # one row and one column past a block and a tile
    edges[:128, 128:256] = 0  # an all-zero 128x128 block (and its tiles)
    edges[129, :] = 0  # an all-zero row of tiles
    special = _wide(3, 300, seed=2)
    special[0, 5] = math.nan
    special[1, 7] = math.inf
    special[2, 299] = -math.inf
    huge = torch.randn(64, 96) * 1e6  # amax > fmax: scales below 1
    tiny = torch.randn(8, 40) * 1e-38  # float32 subnormal-ish: fmax / amax overflows
    return {
        "edges": edges,
        "special": special,
        "activation_3d": _wide(2, 5, 300, seed=3),
        "vector": _wide(1000, seed=4),
        "huge": huge,
        "tiny": tiny,
        "zeros": torch.zeros(5, 129),
        "fp16": _wide(40, 200, seed=5).clamp(-6e4, 6e4).half(),
    }


@pytest.mark.parametrize("case", sorted(_cases()))
def test_every_share_equals_torchs_float8_casts(case: str) -> None:
    x = _cases()[case]
    measured = shares(quantisation_counts([x])[0].tolist(), x.numel())
    for scaling in wire.FP8_SCALINGS:
        for fmt in wire.FP8_FORMATS:
            truth = direct(x, fmt, scaling)
            for metric in ("flush", "saturate"):
                assert measured[f"{fmt}_{scaling}_{metric}"] == truth[metric], (fmt, scaling)
            assert measured[f"{fmt}_{scaling}_error"] == pytest.approx(truth["error"], rel=1e-4)
            if scaling != "tensor":
                assert measured[f"{scaling}_spread"] == pytest.approx(truth["spread"], abs=1e-5)


def reference_counts(x: torch.Tensor) -> list[float]:
    """The straightforward implementation (the agent's before issue 29): per scaling, a
    zero-padded grouped copy; per format, the scaled values, their counts, and torch's
    saturating float8 cast and decode; the same float32 steps, summed in float64."""
    a = torch.nan_to_num(x.detach().float(), 0.0, 0.0, 0.0).abs_()
    a = a.reshape(1, -1) if a.dim() < 2 else a.reshape(-1, a.shape[-1])
    parts: list[float] = []
    spreads: list[float] = []
    norm_sq = None
    for scaling in wire.FP8_SCALINGS:
        if scaling == "tensor":
            groups = a.reshape(1, -1)
        else:
            height, width = GROUP[scaling]
            padded = torch.nn.functional.pad(a, (0, -a.shape[1] % width, 0, -a.shape[0] % height))
            r, c = padded.shape
            groups = (
                padded.reshape(r // height, height, c // width, width)
                .permute(0, 2, 1, 3)
                .reshape(-1, height * width)
            )
        amax = groups.amax(dim=-1, keepdim=True)
        zeros = int((groups == 0).sum())
        for fmt in wire.FP8_FORMATS:
            dtype, fmax, top = FORMATS[fmt]
            if scaling == "mx":
                mantissa, exponent = torch.frexp(amax)
                shared = (exponent - top + (mantissa > 0.875).int()).clamp(-127, 127)
                scale = torch.ldexp(torch.ones_like(amax), -shared)
            else:
                scale = torch.full_like(amax, fmax).div_(amax).clamp_(max=3.4028234663852886e38)
            scale = torch.where(amax > 0, scale, torch.ones_like(amax))
            y = groups * scale
            if norm_sq is None:
                norm_sq = float(
                    (y.square().sum(-1, dtype=torch.float64) / scale.double().square().T).sum()
                )
            q = y.clamp(max=fmax).to(dtype).float()
            parts.append(int((q == 0).sum()) - zeros)
            parts.append(
                int(torch.isinf(y.to(dtype).float()).sum())
                if fmt == "e5m2"
                else int((y > 464.0).sum())
            )
            group_sq = (q - y).square().sum(dim=-1, keepdim=True, dtype=torch.float64)
            parts.append(float((group_sq / scale.double().square()).sum()))
        if scaling != "tensor":
            positive = amax[amax > 0]
            spreads.append(float(torch.log2(amax.max() / positive.min())) if len(positive) else 0.0)
    assert norm_sq is not None
    return [*parts, norm_sq, *spreads]


def _adversarial() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    limits = torch.randn(30, 300, generator=generator)
    limits[:, ::7] = 448.0
    limits[:, 1::11] = 57344.0
    limits[::3, 2::13] = -464.0
    limits[0, 0], limits[1, 1], limits[2, 2] = 61440.0, 3.4e38, -3.4e38
    limits[3, :] = 448.0  # a row at E4M3's max: every tile's amax maps to itself
    steps = torch.tensor([[448.0, 464.0, 432.0, 480.0, 2**-10, 2**-9, 3 * 2**-10, 1.0]])
    nan_rows = torch.randn(9, 140, generator=generator)
    nan_rows[0, 3], nan_rows[2, 5], nan_rows[8, 139] = math.nan, math.inf, -math.inf
    nan_rows[4] = math.nan
    exponents = torch.randint(-149, 0, (40, 200), generator=generator).float()
    return {
        "zeros": torch.zeros(5, 129),
        "one_element": torch.tensor([3.0]),
        "one_subnormal": torch.tensor([1e-45]),
        "subnormals": torch.randn(40, 200, generator=generator) * 1e-40,
        "down_to_subnormals": torch.randn(40, 200, generator=generator) * torch.exp2(exponents),
        "limits": limits,
        "rounding_steps": steps,
        "nan_inf": nan_rows,
        "all_nan": torch.full((3, 40), math.nan),
        "float32_max": torch.full((4, 4), 3.4e38),
        "grid_0_to_500": torch.linspace(0, 500, 128 * 40).reshape(40, 128),
        "fp16": (torch.randn(64, 200, generator=generator) * 1000).half(),
        "bf16_tiny": (torch.randn(64, 200, generator=generator) * 1e-20).bfloat16(),
        "fp64_tiny": torch.randn(20, 50, dtype=torch.float64, generator=generator) * 1e-30,
        "block_edges": _wide(131, 257, seed=8),
    }


def _random_tensors(count: int) -> list[torch.Tensor]:
    """Shapes around the 32 / 128 group sizes (1-D, 2-D, 3-D), values over ~100 binary
    orders of magnitude, some zeros."""
    generator = torch.Generator().manual_seed(11)
    out = []
    for _ in range(count):
        dims = int(torch.randint(1, 4, (1,), generator=generator))
        shape = [int(torch.randint(1, 200, (1,), generator=generator)) for _ in range(dims)]
        if dims == 3:
            shape[0] = min(shape[0], 4)
        x = torch.randn(*shape, generator=generator)
        x = x * torch.exp2(torch.randint(-70, 30, shape, generator=generator).float())
        x[torch.rand(*shape, generator=generator) < 0.05] = 0
        out.append(x)
    return out


def _assert_same(got: list[float], want: list[float], case: str) -> None:
    """Counts and spreads exactly; float sums of squares to float32 summation (the new
    one sums 1x32 groups in float32 first)."""
    combos = len(wire.FP8_SCALINGS) * len(wire.FP8_FORMATS)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        is_sum = (i < 3 * combos and i % 3 == 2) or i == 3 * combos
        if is_sum:
            assert g == pytest.approx(w, rel=1e-6, abs=0), (case, i)
        else:
            assert g == w, (case, i)


def test_one_read_equals_the_straightforward_implementation() -> None:
    """Adversarial and random tensors through one shared workspace, in one order: stale
    buffers (a larger tensor measured before a smaller one) would show."""
    workspace = Workspace()
    cases = {**_adversarial(), **{f"random{i}": x for i, x in enumerate(_random_tensors(16))}}
    for case, x in cases.items():
        _assert_same(quantisation_counts([x], workspace)[0].tolist(), reference_counts(x), case)
    assert len(reference_counts(torch.ones(1))) == VALUES_PER_TENSOR


def test_nothing_saturates_under_current_or_rounded_up_mx_scaling() -> None:
    """The saturate count is 0 without a pass (see SATURATE_ABOVE): the casts agree on
    tensors at and past both formats' limits, and on every random tensor."""
    for x in [_adversarial()["limits"], _adversarial()["float32_max"], *_random_tensors(8)]:
        assert reference_counts(x)[1:24:3] == [0] * 8


def test_the_cases_exercise_what_they_claim() -> None:
    """Guards the test above against vacuous data: the wide data flushes; nothing
    saturates (every scaling maps the group's amax to <= fmax); NaN/Inf change nothing
    about the finite elements' shares."""
    cases = _cases()
    wide = shares(quantisation_counts([cases["edges"]])[0].tolist(), cases["edges"].numel())
    assert wide["e4m3_tensor_flush"] > 0.2 and wide["e4m3_tile_flush"] > 0.1
    assert wide["e4m3_mx_saturate"] == 0 and wide["e5m2_tile_saturate"] == 0
    assert wide["e4m3_mx_error"] > wide["e4m3_tile_error"] > 0  # coarser power-of-two scales
    special = cases["special"]
    cleaned = torch.where(torch.isfinite(special), special, torch.zeros_like(special))
    assert quantisation_counts([special])[0].tolist() == quantisation_counts([cleaned])[0].tolist()
    zeros = shares(quantisation_counts([cases["zeros"]])[0].tolist(), cases["zeros"].numel())
    assert set(zeros.values()) == {0.0}
    assert VALUES_PER_TENSOR == 28


def test_outlier_rows_flush_per_tensor_but_not_in_1x128_tiles() -> None:
    torch.manual_seed(0)
    weight = torch.randn(256, 512) * 0.02
    weight[[3, 70, 200]] *= 2.0**22  # three outlier output channels
    s = shares(quantisation_counts([weight])[0].tolist(), weight.numel())
    assert s["e4m3_tensor_flush"] > 0.9
    assert s["e4m3_tile_flush"] == 0.0 and s["e4m3_mx_flush"] == 0.0
    assert s["tile_spread"] == pytest.approx(22, abs=3)


def test_options_fail_fast_with_the_fix() -> None:
    with pytest.raises(ValueError, match="fp8_recipe must be one of"):
        check_options(100, "fp4")
    with pytest.raises(ValueError, match="fp8_stats_every"):
        check_options(-1, None)
    with pytest.raises(ValueError, match="fp8_stats_every"):
        Fp8Monitor(nn.Linear(2, 2), every=0, on_error=print, to_host=lambda t: (t, None))


def test_the_agent_sends_weight_grad_and_activation_shares_from_an_fp16_loop(
    collector: FakeCollector,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 160), nn.ReLU(), nn.Linear(160, 8), nn.Linear(8, 8))
    model[3].requires_grad_(False)  # frozen: weight measured, no gradient
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    inputs: dict[int, list[torch.Tensor]] = {}
    expected: dict[int, dict[str, dict[str, torch.Tensor]]] = {}

    def keep(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if torch.is_grad_enabled() and module is model[0]:
            inputs.setdefault(step, []).append(args[0].detach().clone())

    model[0].register_forward_pre_hook(keep)
    handle = watch(model, optimizer, scaler, transport=collector, fp8_stats_every=3,
                   fp8_recipe="blockwise", flush_interval=0.05)  # fmt: skip
    for step in range(1, 6):
        for _ in range(2):  # gradient accumulation: activations of both micro-batches
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(16, 64) * 3).float().pow(2).mean()
            scaler.scale(loss).backward()
        with torch.no_grad():
            model(torch.randn(4, 64) * 1e6)  # an evaluation forward does not count
        scaler.step(optimizer)
        scaler.update()
        expected[step] = {
            "weight": {"0.weight": model[0].weight.detach().clone(),
                       "3.weight": model[3].weight.detach().clone()},
            "grad": {"0.weight": model[0].weight.grad.clone()},
        }  # fmt: skip
        optimizer.zero_grad()
    handle.detach(timeout=10)
    assert handle.counters["hook_errors"] == 0

    records = collector.fp8_records()
    assert sorted({r["step"] for r in records}) == [1, 4]
    assert collector.events("run_start")[0]["data"]["fp8_recipe"] == "blockwise"
    by_role = {(r["step"], next(iter(r["stats"])).split("_")[1]): r for r in records}
    assert by_role[(1, "weight")]["names"] == ["0.weight", "2.weight", "3.weight"]
    assert by_role[(1, "grad")]["names"] == ["0.weight", "2.weight"]  # 3 is frozen
    assert by_role[(1, "act")]["names"] == ["0.weight", "2.weight", "3.weight"]
    for step in (1, 4):
        for role in ("weight", "grad"):
            record = by_role[(step, role)]
            for name, tensor in expected[step][role].items():
                i = record["names"].index(name)
                truth = direct(tensor, "e4m3", "tile")
                assert record["stats"][f"fp8_{role}_e4m3_tile_flush"][i] == truth["flush"]
                stat = record["stats"][f"fp8_{role}_e5m2_block_error"][i]
                assert stat == pytest.approx(direct(tensor, "e5m2", "block")["error"], rel=1e-4)
        act = by_role[(step, "act")]
        batches = inputs[step]  # layer 0's inputs in the step's two micro-batches
        assert len(batches) == 2
        flushed = sum(round(direct(x, "e4m3", "tile")["flush"] * x.numel()) for x in batches)
        numel = sum(x.numel() for x in batches)
        assert act["stats"]["fp8_act_e4m3_tile_flush"][0] == flushed / numel


def test_a_tied_weight_is_named_as_the_gradient_statistics_name_it(
    collector: FakeCollector,
) -> None:
    """GPT-2 ties `lm_head.weight` to the embedding's: one tensor, which the gradient
    statistics name `embed.weight` (named_parameters() names a shared tensor once). FP8
    readiness must use that name too, or the run's layer list grows a second row for the
    same tensor with no gradient statistics."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 16)
            self.body = nn.Linear(16, 16)
            self.head = nn.Linear(16, 32, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.body(self.embed(tokens))))

    torch.manual_seed(0)
    model = Tied()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = watch(model, optimizer, None, transport=collector, fp8_stats_every=1,
                   layer_stats_every=1, flush_interval=0.05)  # fmt: skip
    model(torch.randint(0, 32, (4, 8))).float().pow(2).mean().backward()
    optimizer.step()
    handle.detach(timeout=10)
    gradient_names = set(collector.layer_stats()[0]["names"])
    fp8_names = {name for r in collector.fp8_records() for name in r["names"]}
    assert fp8_names == {"body.weight", "embed.weight"}
    assert fp8_names <= gradient_names


def test_a_cpu_sample_is_measured_on_the_sender_thread_from_a_copy() -> None:
    """The training thread copies a CPU tensor and returns; `records()` (the sender)
    measures the copy: the weight as it was at the sampled step, though the next step
    changes it in place."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(333, 200), nn.Linear(200, 333))
    errors: list[BaseException] = []
    monitor = Fp8Monitor(model, every=1, on_error=errors.append, to_host=lambda t: (t, None))
    x = torch.randn(2, 16, 333) * 1e3
    model(x).pow(2).mean().backward()
    weight, grad = model[0].weight.detach().clone(), model[0].weight.grad.clone()
    sample = monitor.after_step(1)
    assert sample is not None and sample.values is None  # nothing measured yet
    with torch.no_grad():  # what the next optimizer step and zero_grad() do
        model[0].weight.mul_(1e6)
        model[0].weight.grad.zero_()
    by_role = {r["names"][0] + next(iter(r["stats"])).split("_")[1]: r for r in sample.records()}
    assert errors == []
    for key, tensor in (("0.weightweight", weight), ("0.weightgrad", grad), ("0.weightact", x)):
        truth = shares(reference_counts(tensor), tensor.numel())
        stats = by_role[key]["stats"]
        role = key.removeprefix("0.weight")
        assert stats[f"fp8_{role}_e4m3_tile_flush"][0] == truth["e4m3_tile_flush"]
        assert stats[f"fp8_{role}_e5m2_block_error"][0] == pytest.approx(
            truth["e5m2_block_error"], rel=1e-6
        )


def test_a_failure_on_the_sender_costs_the_sample_not_the_sender(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = nn.Linear(40, 8)
    errors: list[BaseException] = []
    monitor = Fp8Monitor(model, every=1, on_error=errors.append, to_host=lambda t: (t, None))
    model(torch.randn(4, 40)).sum().backward()
    sample = monitor.after_step(1)
    assert sample is not None

    def broken(x: torch.Tensor, workspace: Workspace | None = None) -> torch.Tensor:
        raise RuntimeError("an odd tensor")

    monkeypatch.setattr(fp8, "quantisation_counts", broken)
    assert sample.records() == []
    assert [str(e) for e in errors] == ["an odd tensor"]
    monkeypatch.undo()
    model(torch.randn(4, 40)).sum().backward()
    later = monitor.after_step(2)
    assert later is not None and len(later.records()) == 3  # the next sample goes on
