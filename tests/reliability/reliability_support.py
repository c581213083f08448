"""What the reliability tests share besides fixtures: a small real FP16 training loop,
exactly-once checks on the stored rows, and wire batches built like the agent's.

`tests/agent/test_spool_live.py` imports `Trainer` from here by file name (it puts this
folder on `sys.path`), so the two suites time the same loop."""

from __future__ import annotations

import gzip
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import torch
from sqlalchemy import func, select
from torch import nn

from ampwatch.agent import watch
from ampwatch.agent.wire import LAYER_STATS, WIRE_VERSION
from ampwatch.server.layer_models import LayerStat
from ampwatch.server.models import Event, IngestedBatch, Run
from ampwatch.server.step_models import Step

LAYER_STATS_EVERY = 10
STEPS_DEFAULT = 120


class Trainer:
    """A small FP16 autocast MLP with a GradScaler on the CPU; times every step."""

    def __init__(self, width: int = 128, depth: int = 3) -> None:
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.model = nn.Sequential(*layers, nn.Linear(width, 16))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.scaler = torch.amp.GradScaler("cpu")
        self.inputs = torch.randn(32, 64)

    def watch(self, **kwargs: Any) -> Any:
        kwargs.setdefault("flush_interval", 0.05)
        kwargs.setdefault("layer_stats_every", LAYER_STATS_EVERY)
        kwargs.setdefault("fp8_stats_every", None)  # the counts below are gradient records
        return watch(self.model, self.optimizer, self.scaler, **kwargs)

    def step(self) -> float:
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = self.model(self.inputs).float().pow(2).mean()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad()
        return time.perf_counter() - started

    def train(self, steps: int) -> list[float]:
        return [self.step() for _ in range(steps)]


def slowdown(watched: list[float], bare: list[float]) -> float:
    """Median ratio of interleaved watched/bare step times (1.0: no slowdown)."""
    return statistics.median(w / b for w, b in zip(watched, bare, strict=True))


def thread_cpu_seconds(name: str) -> float:
    """CPU seconds (user + system) the thread of this process called `name` has used, from
    /proc (Linux): what a thread costs, which a loaded machine's scheduling does not move
    as it moves wall-clock step times."""
    for thread in threading.enumerate():
        if thread.name == name and thread.native_id is not None:
            stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()  # after the name: field 3 onwards
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    raise LookupError(f"no thread named {name}")


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def stored_run(rows: Any, client_run_id: str) -> dict[str, Any]:
    """What the database holds for one run: counts that reveal any loss or duplicate."""
    run_id = rows.scalar(select(Run.id).where(Run.client_run_id == client_run_id))
    assert run_id is not None, f"run {client_run_id} not stored"
    step_count, distinct, first, last = rows.rows(
        select(func.count(), func.count(func.distinct(Step.step)), func.min(Step.step),
               func.max(Step.step)).where(Step.run_id == run_id)
    )[0]  # fmt: skip
    kinds = dict(rows.rows(
        select(Event.kind, func.count()).where(Event.run_id == run_id).group_by(Event.kind)
    ))  # fmt: skip
    seqs: dict[str, list[int]] = {}
    for stream, seq in rows.rows(
        select(IngestedBatch.stream, IngestedBatch.seq)
        .where(IngestedBatch.run_id == run_id)
        .order_by(IngestedBatch.stream, IngestedBatch.seq)
    ):
        seqs.setdefault(stream, []).append(seq)
    dropped = rows.rows(
        select(Run.dropped_steps, Run.dropped_layer_stats, Run.dropped_events).where(
            Run.id == run_id
        )
    )[0]
    return {
        "run_id": run_id,
        "steps": step_count,
        "distinct_steps": distinct,
        "first_step": first,
        "last_step": last,
        "layer_steps": rows.scalar(
            select(func.count(func.distinct(LayerStat.step))).where(LayerStat.run_id == run_id)
        ),
        "events": kinds,
        "seqs": seqs,
        "dropped": dict(zip(("steps", "layer_stats", "events"), dropped, strict=True)),
    }


def assert_exactly_once(stored: dict[str, Any], steps: int) -> None:
    """Every step once (1..steps), every sampled step's layer statistics, one run_start
    and one run_end, and each stream's batches numbered 0..n-1 with no gap or repeat."""
    assert (stored["steps"], stored["distinct_steps"]) == (steps, steps), stored
    assert (stored["first_step"], stored["last_step"]) == (1, steps), stored
    assert stored["layer_steps"] == len(range(1, steps + 1, LAYER_STATS_EVERY)), stored
    assert stored["events"].get("run_start") == 1 and stored["events"].get("run_end") == 1
    for stream, seqs in stored["seqs"].items():
        assert seqs == list(range(len(seqs))), (stream, seqs)


def layer_names(n: int) -> list[str]:
    return [f"blocks.{i // 4}.layer{i % 4}.weight" for i in range(n)]


def wire_batch(
    client_run_id: str,
    seq: int,
    *,
    steps_per_batch: int,
    layers: int,
    layer_every: int,
    project: str = "default",
    stream: str = "10ad",
    nan_step: int | None = None,
) -> tuple[bytes, int, int]:
    """A gzip wire batch as the agent seals it: (body, step records, layer values);
    `nan_step`: a step whose loss is NaN (nan_loss fires)."""
    first = seq * steps_per_batch + 1
    steps = [
        {"step": s, "rank": 0, "skipped": s % 97 == 0,
         "loss": "NaN" if s == nan_step else 2.0 + (s % 13) / 13,
         "loss_scale": 65536.0, "grad_norm": 0.5, "lr": 1e-3,
         "act_norm_mean": 7.5, "act_norm_max": 11.0}
        for s in range(first, first + steps_per_batch)
    ]  # fmt: skip
    names = layer_names(layers)
    sampled = [s for s in range(first, first + steps_per_batch) if (s - 1) % layer_every == 0]
    layer_stats = [
        {"step": s, "rank": 0, "names": names,
         "stats": {stat: [((s + i) % 17) / 17 for i in range(layers)] for stat in LAYER_STATS}}
        for s in sampled
    ]  # fmt: skip
    batch = {
        "wire_version": WIRE_VERSION,
        "run": {"client_run_id": client_run_id, "name": client_run_id, "project": project},
        "stream": stream,
        "seq": seq,
        "steps": steps,
        "layer_stats": layer_stats,
        "events": [],
        "dropped": {"steps": 0, "layer_stats": 0, "events": 0},
    }
    body = gzip.compress(orjson.dumps(batch), compresslevel=1)
    return body, len(steps), len(sampled) * layers * len(LAYER_STATS)
