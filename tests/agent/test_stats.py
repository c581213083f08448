"""The host-side range arithmetic at the edges a training run rarely reaches."""

from __future__ import annotations

import math

import torch

from ampwatch.agent.stats import (
    gradient_range,
    histogram_spans,
    power_of_two_exponent,
    range_fractions,
)


def _values(grad: torch.Tensor, scale: float, *, direct: bool = False) -> list[float]:
    return gradient_range([grad], torch.tensor(scale), direct=direct).tolist()


def test_power_of_two_exponent() -> None:
    assert power_of_two_exponent(2.0**-130) == -130  # a float32-subnormal scale is still exact
    assert power_of_two_exponent(0.0) == -math.inf
    assert power_of_two_exponent(1000.0) is None
    assert power_of_two_exponent(math.inf) is None


def test_a_collapsed_scale_of_zero_flushes_every_finite_nonzero_gradient() -> None:
    grad = torch.tensor([0.0, 1e-40, 3.0, 7e4, math.inf, math.nan])
    stats, _ = range_fractions(_values(grad, 0.0), [6], direct=False)
    assert stats["zero_fraction"] == [1 / 6]
    assert stats["flush_fraction"] == [3 / 6]  # 1e-40, 3.0 and 7e4: inf*0 and NaN are not
    assert stats["subnormal_fraction"] == [0.0]


def test_float32_subnormals_at_a_huge_scale_are_left_out_not_guessed() -> None:
    grad = torch.tensor([1e-40, 1.0])
    stats, hists = range_fractions(_values(grad, 2.0**110), [2], direct=False)
    assert "flush_fraction" not in stats and "subnormal_fraction" not in stats
    assert stats["zero_fraction"] == [0.0] and hists[0][0] == 1


def test_an_unexpected_non_power_of_two_scale_without_direct_counts_is_left_out() -> None:
    stats, _ = range_fractions(_values(torch.tensor([1e-9, 1.0]), 3.0), [2], direct=False)
    assert set(stats) == {"zero_fraction", "max_abs_scaled"}
    stats, _ = range_fractions(
        _values(torch.tensor([1e-9, 1.0]), 3.0, direct=True), [2], direct=True
    )
    assert stats["flush_fraction"] == [0.5]  # 3e-9 < 2^-24


def test_fp16_and_bf16_gradients_are_binned_by_their_float32_exponent() -> None:
    for dtype in (torch.float16, torch.bfloat16):
        grad = torch.tensor([2.0**-20, 0.5, 0.0], dtype=dtype)
        _, hists = range_fractions(_values(grad, 1.0), [3], direct=False)
        assert histogram_spans(hists) == {
            "offsets": [0],
            "counts": [[1] + [0] * 106 + [1] + [0] * 18 + [1]],
        }


def test_the_histogram_shift_matches_direct_counts_at_every_power_of_two_scale() -> None:
    torch.manual_seed(0)
    magnitudes = 2.0 ** torch.randint(-149, 127, (4096,)).double()
    grad = (torch.randn(4096).double() * magnitudes).float()
    grad[::97] = 0.0
    n = grad.numel()
    for k in [*range(-149, 103, 3), 102, -1, 0]:
        scale = 2.0**k
        stats, _ = range_fractions(_values(grad, scale), [n], direct=False)
        scaled = grad.double().abs() * scale
        flush = int(((scaled < 2.0**-24) & (grad != 0)).sum()) / n
        subnormal = int(((scaled >= 2.0**-24) & (scaled < 2.0**-14)).sum()) / n
        assert (stats["flush_fraction"], stats["subnormal_fraction"]) == ([flush], [subnormal]), k
