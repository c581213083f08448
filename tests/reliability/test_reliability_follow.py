"""`ampwatch follow` (its own process) on a log this test appends to while the collector
is SIGKILLed and restarted, and the training process restarts and appends: every step
stored once, each process's start once, and Ctrl-C exits 0.

On the local PostgreSQL (skipped without it), collectors as real processes
(`reliability_procs.CollectorProcess`).
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from reliability_procs import record_figure, wait_for
from sqlalchemy import func, select

from ampwatch.server.models import Event, IngestedBatch
from ampwatch.server.step_models import Step

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _generator():  # type: ignore[no-untyped-def]
    """bench/import.py's Megatron log generator (one home for the synthetic log)."""
    sys.path.insert(0, str(BENCH))
    return importlib.import_module("import")


def test_follow_delivers_every_step_once_across_a_killed_collector(  # type: ignore[no-untyped-def]
    collector_process, rows, tmp_path
) -> None:
    gen = _generator()
    collector = collector_process(workers=1)
    port = int(collector.url.rsplit(":", 1)[1])
    log = tmp_path / "train.log"
    first = [t for t in gen.megatron_lines(1, 250) if t.startswith(" iteration ")]
    log.write_text("".join(first[:100]) + first[100][:50])  # a last line still being written
    follower = subprocess.Popen(
        [sys.executable, "-m", "ampwatch.server.cli", "follow", str(log), "--url",
         collector.url, "--poll", "0.05", "--run", "followed"],
        env={**os.environ, "AMPWATCH_SPOOL_DIR": str(tmp_path / "spool")},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        steps = lambda: rows.scalar(select(func.count()).select_from(Step))  # noqa: E731
        wait_for(lambda: steps() == 100, 60, "the first 100 steps")
        collector.kill()
        with log.open("a") as out:  # the writer goes on while the collector is down
            out.write(first[100][50:])
            out.writelines(first[101:])
            out.flush()
            # the training process restarts from its checkpoint at 200 and appends
            out.write("using world size: 8, data-parallel size: 8\n")
            out.writelines(
                t for t in gen.megatron_lines(201, 300, seed=1) if t.startswith(" iteration ")
            )
        spool = tmp_path / "spool"
        wait_for(lambda: any(spool.rglob("*.spool")), 60, "the follower to spool")
        collector = collector_process(workers=1, port=port)
        wait_for(lambda: steps() == 300, 120, "every step after the restart")
    finally:
        follower.send_signal(signal.SIGINT)
        raw, _ = follower.communicate(timeout=60)  # waits, and closes its pipe
        rc, output = follower.returncode, raw.decode()
    assert rc == 0, output
    assert "a new process" in output and "steps sent" in output, output
    assert steps() == 300  # 1..300 once: the second process's 201..250 overwrote the first's
    starts = rows.rows(select(Event.data).where(Event.kind == "run_start"))
    assert sorted(row[0]["process"] for row in starts) == [0, 1]
    streams = rows.scalar(select(func.count(func.distinct(IngestedBatch.stream))))
    assert streams == 2
    record_figure("follow", f"300 steps through a SIGKILLed collector, {streams} streams, "
                  f"stored once; follower exit {rc} on SIGINT")  # fmt: skip
