"""The overhead benchmarks still run (one quick round); their figures are read by people."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench"


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("agent_overhead.py", ["defaults  wall ratio median", "isolated share of the bare step"]),
        ("fp8_overhead.py", ["one tensor 256x256", "step-time ratio", "what FP8 adds"]),
    ],
)
def test_the_overhead_bench_runs_a_quick_round(script: str, expected: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", "--sizes", "0.1M"],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    for text in expected:
        assert text in result.stdout
