"""The benches still run: each `--quick` on SQLite (the figures themselves are not tested:
bars are measured by running the benches, not by timed unit tests)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize(
    "script", ["ingest.py", "query.py", "metrics.py", "load.py", "read_cost.py"]
)
def test_bench_quick_runs_and_reports(script: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", "--backend", "sqlite"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    # Exit 1 only means a bar was missed on a loaded machine; loss or a crash is a failure.
    assert done.returncode in (0, 1), done.stderr
    assert "Traceback" not in done.stderr
    if script == "ingest.py":
        assert "zero loss" in done.stdout, done.stdout
    elif script == "metrics.py":
        assert "/metrics median" in done.stdout, done.stdout
    elif script == "load.py":  # 0 errors is a bar even on a loaded machine
        phases = [line for line in done.stdout.splitlines() if "| errors " in line]
        assert len(phases) == 2 and "bogus tokens" in phases[1], done.stdout
        assert all("| errors 0 " in line for line in phases), done.stdout
        # Both kinds of the collector's processes found (by its process tree) and counted.
        used = re.search(r"serving +([0-9.]+) s .* ingest +([0-9.]+) s", done.stdout)
        assert used and float(used[1]) > 0 and float(used[2]) > 0, done.stdout
    elif script == "read_cost.py":  # every route answered (a non-200 is an AssertionError)
        assert done.returncode == 0 and done.stdout.count(" cpu ") == 8, done.stdout
    else:
        assert "heatmap" in done.stdout, done.stdout


def test_detection_bench_runs_and_reports() -> None:
    """bench/detection.py on two of its scenarios (the whole catalog is tests/scenarios)."""
    done = subprocess.run(
        [sys.executable, str(BENCH / "detection.py"), "--only", "healthy_bf16", "nan_loss"],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr  # 1: a bar was missed
    assert "healthy_bf16" in done.stdout and "nan_loss" in done.stdout, done.stdout
    assert "bars:" in done.stdout, done.stdout


def test_import_bench_runs_and_reports() -> None:
    """bench/import.py --quick: a 20,000-iteration log imported, 4 s of follow at 1,000/s."""
    done = subprocess.run(
        [sys.executable, str(BENCH / "import.py"), "--quick"],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr  # 1: a bar missed on a loaded machine
    assert "Traceback" not in done.stderr
    assert "20,000 steps stored" in done.stdout, done.stdout  # nothing lost, whatever the speed
    assert "(yes)" in done.stdout and "exit 0 on SIGINT" in done.stdout, done.stdout
