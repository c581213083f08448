"""A real gloo process group of two CPU ranks: one run id, ranks tagged, the send policy."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ampwatch.agent import watch


def _worker(rank: int, world_size: int, init_file: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        sent = iter(range(1_000_000))

        def transport(body: bytes, headers: dict[str, str]) -> int:
            (Path(out) / f"rank{rank}-{next(sent):04d}").write_bytes(body)
            return 200

        torch.manual_seed(rank)
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        handle = watch(
            model, optimizer, scaler, transport=transport, layer_stats_every=2, fp8_stats_every=None
        )
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(3, 4)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        # Rank 1 sends no norm: the clips it saw must not pile up, one per step, all run long.
        (Path(out).parent / f"clips-held-{rank}").write_text(str(len(handle._clips or [])))
        handle.detach()
    finally:
        dist.destroy_process_group()


def test_rank0_sends_steps_every_rank_sends_layer_stats(tmp_path: Path) -> None:
    out = tmp_path / "bodies"
    out.mkdir()
    os.environ.pop("AMPWATCH_RUN_ID", None)
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, join=True)

    assert [(tmp_path / f"clips-held-{r}").read_text() for r in (0, 1)] == ["0", "0"]
    batches = {0: [], 1: []}
    for path in sorted(out.iterdir()):
        batches[int(path.name[4])].append(json.loads(gzip.decompress(path.read_bytes())))
    run_ids = {b["run"]["client_run_id"] for rank in (0, 1) for b in batches[rank]}
    assert len(run_ids) == 1  # rank 0's id, broadcast at attach
    for rank in (0, 1):
        steps = [s for b in batches[rank] for s in b["steps"]]
        layers = [r for b in batches[rank] for r in b["layer_stats"]]
        events = [e for b in batches[rank] for e in b["events"]]
        assert [s["step"] for s in steps] == ([1, 2, 3] if rank == 0 else [])
        assert all(s["rank"] == 0 for s in steps)
        assert [(r["step"], r["rank"]) for r in layers] == [(1, rank), (3, rank)]
        start = next(e for e in events if e["kind"] == "run_start")["data"]
        assert (start["rank"], start["world_size"]) == (rank, 2)
