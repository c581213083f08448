"""Numbers as the alert engine reads and writes them: a wire float made finite-or-None, a
value for a message, a ratio in octaves."""

from __future__ import annotations

import math
from typing import Any

from ampwatch.agent.wire import decode_float


def finite(value: Any) -> float | None:
    number = decode_float(value) if value is not None else None
    return number if number is not None and math.isfinite(number) else None


def fmt(value: float | None) -> str:
    if value is None:
        return "none"
    return f"{value:g}"


def octaves(ratio: float) -> str:
    """'2^-17' for a power of two, else '2^-16.6'."""
    if ratio <= 0:
        return "0"
    exponent = math.log2(ratio)
    return f"2^{exponent:.0f}" if abs(exponent - round(exponent)) < 1e-9 else f"2^{exponent:.1f}"
