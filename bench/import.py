"""`ampwatch import` and `ampwatch follow` speed, on a generated Megatron-LM log.

    python bench/import.py            # full: 1,000,000 iterations; follow 30 s at 1,000 lines/s
    python bench/import.py --quick    # 20,000 iterations; follow 4 s (the smoke test)
    python bench/import.py --backend postgres
    python bench/import.py --only import --iterations 100000   # a smaller log (profiling)

Bars (issue 15): the 1,000,000-iteration log imports (parse, batch, send, stored by the
collector) in under a minute on this machine, and `follow` keeps up with a log written at
1,000 lines/s (every step stored within 5 s of the last write) using under 5% of one core
(its process CPU time, utime + stime from /proc, over the writing phase, after start-up).
The import line also gives the CPU seconds the importer (this process: parse, batch, send)
and the collector (its process: HTTP, validation, storage, alert evaluation) spent, so a
figure taken on a loaded machine still says where the time goes, and the load average.

The log is generated into a temporary directory at bench time (never committed): one
iteration line per iteration (log interval 1, Megatron's format, a loss scale, grad
norm, lr and the skip counters), an OVERFLOW line (Megatron-DeepSpeed) before every
997th iteration, and a "saving checkpoint" line every 10,000. The collector runs as `ampwatch
serve` in a subprocess (bench/collector.py), sharing this machine's cores with the bench.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from collector import drop_postgres_database, postgres_database, start_server
from sqlalchemy import func, select

from ampwatch.agent.logs import Target, import_logs, parse_file
from ampwatch.server.db import make_engine
from ampwatch.server.step_models import Step

OVERFLOW_EVERY = 997
CHECKPOINT_EVERY = 10_000
TOTAL = 1_000_000


def iteration_line(it: int, scale: float, rng: random.Random, total: int = TOTAL) -> str:
    loss = 2.0 + 8.0 / (1 + it / 1000) + rng.random() * 0.05
    return (f" iteration {it:>8}/{total:>8} | consumed samples: {it * 512:>12} | elapsed time "
            f"per iteration (ms): {400 + rng.random() * 20:.1f} | learning rate: {6e-5:.3E} | "
            f"global batch size:   512 | lm loss: {loss:.6E} | loss scale: {scale:.1f} | "
            f"grad norm: {0.5 + rng.random():.3f} | number of skipped iterations:   0 | "
            "number of nan iterations:   0 |\n")  # fmt: skip


def megatron_lines(first: int, last: int, seed: int = 0) -> list[str]:
    """Iterations first..last as Megatron(-DeepSpeed) prints them."""
    rng = random.Random(seed)
    scale = 65536.0
    out = []
    for it in range(first, last + 1):
        if it % OVERFLOW_EVERY == 0:
            out.append("[2024-01-01 00:00:00,000] [INFO] [stage_1_and_2.py:1644:step] [deepspeed] "
                       f"OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {scale}, "
                       f"reducing to {scale / 2}\n")  # fmt: skip
            scale /= 2
        out.append(iteration_line(it, scale, rng))
        if it % CHECKPOINT_EVERY == 0:
            out.append(f"saving checkpoint at iteration {it:>8} to /ckpt/iter_{it:07d}\n")
        if it % 2000 == 0:
            scale *= 2
    return out


def write_log(path: Path, iterations: int) -> None:
    with path.open("w") as out:
        for start in range(1, iterations + 1, 100_000):
            out.writelines(megatron_lines(start, min(iterations, start + 99_999), seed=start))


def stored_steps(database_url: str) -> int:
    engine = make_engine(database_url)
    with engine.connect() as db:
        n = db.execute(select(func.count()).select_from(Step)).scalar_one()
    engine.dispose()
    return int(n)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for(condition, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def bench_import(
    url: str, database_url: str, folder: Path, iterations: int, server_pid: int
) -> tuple[bool, str]:
    log = folder / "megatron.log"
    started = time.perf_counter()
    write_log(log, iterations)
    generated = time.perf_counter() - started
    size = log.stat().st_size / 1e6
    started = time.perf_counter()
    parsed = parse_file(log)
    parse_s = time.perf_counter() - started
    started = time.perf_counter()
    client_cpu, server_cpu = time.process_time(), cpu_seconds(server_pid)
    report = import_logs([str(log)], Target(url, name="bench-import"), log=lambda _: None)
    total_s = time.perf_counter() - started
    client_cpu, server_cpu = time.process_time() - client_cpu, cpu_seconds(server_pid) - server_cpu
    stored = stored_steps(database_url)
    ok = stored == iterations and report.upload is not None and report.upload.complete
    line = (f"import     {iterations:,} iterations ({size:.0f} MB, generated in {generated:.1f} s): "
            f"parse {parse_s:.1f} s ({iterations / parse_s:,.0f} lines/s), import end to end "
            f"{total_s:.1f} s (CPU: importer {client_cpu:.1f} s, collector {server_cpu:.1f} s; "
            f"load average {os.getloadavg()[0]:.1f}), {stored:,} steps stored, "
            f"{len(parsed.checkpoints)} checkpoints "
            + (f"[bar < 60 s: {'ok' if ok and total_s < 60 else 'MISSED'}]" if iterations == TOTAL
               else "[the bar is for 1,000,000 iterations; counts checked]"))  # fmt: skip
    return ok and (iterations < TOTAL or total_s < 60), line


def bench_follow(url: str, database_url: str, folder: Path, seconds: float,
                 rate: int = 1000) -> tuple[bool, str]:  # fmt: skip
    log = folder / "follow.log"
    log.write_text("")
    before = stored_steps(database_url)
    env = {**os.environ, "AMPWATCH_SPOOL_DIR": str(folder / "spool")}
    follower = subprocess.Popen(
        [sys.executable, "-m", "ampwatch.server.cli", "follow", str(log), "--url", url,
         "--format", "megatron", "--run", "bench-follow"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    assert follower.stdout is not None
    follower.stdout.readline()  # "following ...": imports done, the loop starts
    lines = megatron_lines(1, int(seconds * rate) + 100, seed=7)
    lines = [t for t in lines if t.startswith(" iteration ")][: int(seconds * rate)]
    cpu_start, wall_start = cpu_seconds(follower.pid), time.monotonic()
    tick = 0.1
    with log.open("a") as out:
        for i in range(0, len(lines), int(rate * tick)):
            out.writelines(lines[i : i + int(rate * tick)])
            out.flush()
            time.sleep(max(0.0, wall_start + (i / rate) + tick - time.monotonic()))
    written_at = time.monotonic()
    caught_up = wait_for(lambda: stored_steps(database_url) - before >= len(lines), 30.0)
    lag = time.monotonic() - written_at
    cpu = cpu_seconds(follower.pid) - cpu_start
    wall = time.monotonic() - wall_start
    follower.send_signal(signal.SIGINT)
    follower.communicate(timeout=60)  # waits, and closes its pipe
    rc = follower.returncode
    share = 100 * cpu / wall
    ok = caught_up and lag <= 5.0 and share < 5.0 and rc == 0
    line = (f"follow     {len(lines):,} lines at {rate:,}/s over {wall:.1f} s: all stored "
            f"{lag:.1f} s after the last write ({'yes' if caught_up else 'NO'}), follower CPU "
            f"{cpu:.2f} s = {share:.1f}% of one core, exit {rc} on SIGINT "
            f"[bar < 5%, lag <= 5 s: {'ok' if ok else 'MISSED'}]")  # fmt: skip
    return ok, line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--only", choices=["import", "follow"], help="run one phase")
    parser.add_argument("--iterations", type=int, help="the import's log length (the bar: "
                        f"{TOTAL:,}, the default; --quick: 20,000)")  # fmt: skip
    args = parser.parse_args()
    iterations, seconds = (20_000, 4.0) if args.quick else (TOTAL, 30.0)
    iterations = args.iterations or iterations
    results: list[tuple[bool, str]] = []
    with tempfile.TemporaryDirectory(prefix="ampwatch-bench-import-") as tmp:
        folder = Path(tmp)
        database_url = (postgres_database() if args.backend == "postgres"
                        else f"sqlite:///{folder / 'bench.db'}")  # fmt: skip
        if database_url is None:
            return 1
        server, url = start_server(database_url)
        try:
            httpx.get(f"{url}/readyz", timeout=10)
            if args.only in (None, "import"):
                results.append(bench_import(url, database_url, folder, iterations, server.pid))
            if args.only in (None, "follow"):
                results.append(bench_follow(url, database_url, folder, seconds))
        finally:
            server.terminate()
            server.wait(timeout=30)
            if args.backend == "postgres":
                drop_postgres_database(database_url)
    print(f"backend    {args.backend}")
    for _, line in results:
        print(line)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
