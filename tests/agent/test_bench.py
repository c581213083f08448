"""The overhead benchmarks still run (one quick round); their figures are read by people."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench"


@pytest.mark.parametrize(
    ("script", "args", "expected"),
    [
        (
            "agent_overhead.py",
            ["--sizes", "0.1M"],
            ["defaults  wall ratio median", "isolated share of the bare step"],
        ),
        (
            "fp8_overhead.py",
            ["--models", "0.1M"],
            [
                "200x333 (0.07M values): one tensor",
                "sampled / plain step median",
                "average at M = ",
            ],
        ),
    ],
)
def test_the_overhead_bench_runs_a_quick_round(
    script: str, args: list[str], expected: list[str]
) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    for text in expected:
        assert text in result.stdout
