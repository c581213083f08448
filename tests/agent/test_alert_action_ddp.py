"""The stop decision under DDP, with a real gloo group of two CPU ranks and a live
collector: each rank's agent hears the run's alerts on its own sender thread (the agent
issues no collective), and the loop agrees in its own all-reduce (MAX of
`handle.should_stop`, `ampwatch.agent.policy`), so both ranks stop at the same step."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ampwatch.agent import EXIT_CRITICAL_ALERT, watch

BAD_STEP = 5
MAX_STEPS = 400


def _worker(rank: int, init_file: str, url: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(
            nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu")
        handle = watch(model, optimizer, scaler, url=url, flush_interval=0.05, on_critical="stop")
        heard_at = None
        for step in range(1, MAX_STEPS + 1):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            if step == BAD_STEP and rank == 0:
                loss = loss * math.nan  # one rank's bad batch: DDP averages it into both
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if heard_at is None and handle.should_stop:
                heard_at = step
            stop = torch.tensor(float(handle.should_stop))
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # the loop's collective, every rank
            if stop.item():
                break
            time.sleep(0.01)
        result = {"stopped": step, "heard_at": heard_at, "exit_code": handle.exit_code}
        handle.detach("stopped")
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_every_rank_stops_at_the_same_step(tmp_path: Path, live_collector) -> None:
    os.environ.pop("AMPWATCH_RUN_ID", None)
    init = str(tmp_path / "init")
    mp.spawn(_worker, args=(init, live_collector.url, str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    stopped = {r["stopped"] for r in results}
    assert len(stopped) == 1 and BAD_STEP < stopped.pop() < MAX_STEPS
    assert results[0]["heard_at"] is not None  # rank 0 posts every flush: it hears first
    assert results[0]["exit_code"] == EXIT_CRITICAL_ALERT
    print(f"\nstops: {results}")
