"""The overhead benchmark still runs (one quick round); its figures are read by people."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench" / "agent_overhead.py"


def test_the_overhead_bench_runs_a_quick_round() -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--sizes", "0.1M"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "defaults  wall ratio median" in result.stdout
    assert "isolated share of the bare step" in result.stdout
