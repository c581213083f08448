"""Numbers as the alert engine reads and writes them: a wire float made finite-or-None, a
share in [0, 1], a value for a message, a ratio in octaves, a multiple of a positive median."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ampwatch.agent.wire import decode_float


def finite(value: Any) -> float | None:
    number = decode_float(value) if value is not None else None
    return number if number is not None and math.isfinite(number) else None


def shares(values: np.ndarray) -> np.ndarray:
    """Where `values` are shares (in [0, 1]): a layer statistic that is a fraction of the
    layer's elements. Anything else (NaN, +-Inf, a faulty agent's 1e308) teaches no baseline
    and is judged by no rule: with 1.7e308, 2 x a baseline's deviation overflowed.

    >>> shares(np.array([0.0, 1.0, 1.5, -0.1, np.nan])).tolist()
    [True, True, False, False, False]
    """
    return (values >= 0.0) & (values <= 1.0)


def fmt(value: float | None) -> str:
    if value is None:
        return "none"
    return f"{value:g}"


def octaves(ratio: float) -> str:
    """'2^-17' for a power of two, else '2^-16.6'; a quotient that overflowed (a huge scale
    over a tiny one) or is NaN is said as such instead of raising in `round`.

    >>> octaves(2.0**-17), octaves(0.1), octaves(math.inf), octaves(math.nan)
    ('2^-17', '2^-3.3', '2^inf', 'NaN')
    """
    if math.isnan(ratio):
        return "NaN"
    if ratio <= 0:
        return "0"
    if math.isinf(ratio):
        return "2^inf"
    exponent = math.log2(ratio)
    return f"2^{exponent:.0f}" if abs(exponent - round(exponent)) < 1e-9 else f"2^{exponent:.1f}"


def ratio(value: float, median: float) -> float | None:
    """`value` / `median` when the median is positive (a multiple of a typical magnitude);
    None otherwise: "x times 0" is no measure of anything (a zero grad-norm median made
    a norm of 0 "infx its median"). A quotient of two finite doubles can still overflow
    (1e300 over 1e-300): it is then +Inf, stored in the wire's spelling.

    >>> ratio(6.0, 2.0), ratio(1.0, 0.0)
    (3.0, None)
    """
    return value / median if median > 0 else None


def times(value: float, median: float) -> str:
    """`value` against a positive `median` in words: '3.0x', or '2^997x' past a double.

    >>> times(6.0, 2.0), times(1e300, 1e-300)
    ('3.0x', '2^1993x')
    """
    quotient = value / median
    if math.isfinite(quotient):
        return f"{quotient:.1f}x"
    return f"2^{math.log2(value) - math.log2(median):.0f}x"
