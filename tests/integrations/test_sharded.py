"""Sharded training on 2 gloo CPU processes (FSDP2, FSDP1 + ShardedGradScaler, DDP): the
training ends bit-identical to the run without the agent, and what the agent sent matches
the truth the loop computed from full tensors (sharded_run.py runs every case in one spawn).

Before the agent read local shards, these runs were killed (a collective on one rank),
lost every layer sample (`aten.bincount` on a DTensor), stopped the sender (`.tolist()` of
a DTensor), stored nothing under ShardedGradScaler (a 0-d and a 1-d flag stacked) and
stored rank 0's shard norm as the grad norm. A sharded loop that does not clip stored no
grad norm; now every rank sends its part and the collector's stored norm is the truth.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch.multiprocessing as mp
from sharded_run import CASES, EVERY, OVERFLOW_STEPS, STEPS, TinyTransformer, run_cases
from sqlalchemy import select

from ampwatch.agent import wire
from ampwatch.server import migrate
from ampwatch.server.db import make_engine, make_sessionmaker
from ampwatch.server.ingest import ingest_batch
from ampwatch.server.schemas.wire import BatchIn
from ampwatch.server.step_models import Step

#: One spawn runs every case (the first test pays for it): ~1 min of CPU, longer on a
#: loaded host, where each gloo collective waits for both processes to be scheduled.
pytestmark = pytest.mark.timeout(900)

USER_NAMES = {n for n, _ in TinyTransformer().named_parameters()}
NO_NORM_NAMES = {n for n, _ in TinyTransformer(final_norm=False).named_parameters()}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sharded")
    os.environ.pop("AMPWATCH_RUN_ID", None)
    mp.spawn(run_cases, args=(2, str(out / "init"), str(out)), nprocs=2, join=True)
    return out


def _bodies(folder: Path, rank: int) -> list[bytes]:
    return [gzip.decompress(p.read_bytes()) for p in sorted(folder.glob(f"rank{rank}-*"))]


def _sent(folder: Path, rank: int) -> dict[str, list[Any]]:
    batches = [json.loads(body) for body in _bodies(folder, rank)]
    return {
        kind: [r for b in batches for r in b[kind]] for kind in ("steps", "layer_stats", "events")
    }


def _close(got: Any, want: float | None, rel: float = 1e-5) -> bool:
    value = wire.decode_float(got)
    if want is None or value is None:
        return want is value
    if math.isnan(want) or math.isinf(want):
        return not math.isfinite(value)  # an overflowing step's norm: Inf or NaN either way
    return value == pytest.approx(want, rel=rel)


def _gradient_layers(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "zero_fraction" in r["stats"]]


def _stored_grad_norms(folder: Path, url: str) -> dict[int, float | None]:
    """Both ranks' batches through the collector's ingest, interleaved with rank 1's first:
    rank 0's stored grad norm per step."""
    migrate.upgrade(url)
    engine = make_engine(url)
    try:
        sessions = make_sessionmaker(engine)
        bodies = [_bodies(folder, rank) for rank in (0, 1)]
        for index in range(max(map(len, bodies))):
            for rank in (1, 0):
                if index < len(bodies[rank]):
                    with sessions() as session:
                        ingest_batch(session, BatchIn.model_validate_json(bodies[rank][index]))
        with sessions() as session:
            rows = session.execute(select(Step.step, Step.grad_norm).where(Step.rank == 0))
            return {int(step): norm for step, norm in rows}
    finally:
        engine.dispose()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_sharded_case(matrix: Path, case: Any, sqlite_url: str) -> None:
    folder = matrix / case.name
    truths = [json.loads((folder / f"truth{r}.json").read_text()) for r in (0, 1)]
    sent = [_sent(folder, r) for r in (0, 1)]
    truth = truths[0]
    assert truths[0]["identical"] and truths[1]["identical"]  # the agent changed nothing

    steps = sent[0]["steps"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    sharded = case.wrap != "ddp"
    parts = sharded and not case.clip
    if parts:  # every rank its part of the global norm; rank 1 nothing else
        assert [s["step"] for s in sent[1]["steps"]] == list(range(1, STEPS + 1))
        assert {s["grad_parts"] for r in (0, 1) for s in sent[r]["steps"]} == {2}
        assert all(s["loss"] is None and s["grad_norm"] is None for s in sent[1]["steps"])
    else:
        assert sent[1]["steps"] == []  # rank 0 sends the step scalars
    assert [s["rank"] for s in steps] == [0] * STEPS
    assert [s["skipped"] for s in steps] == truth["skipped"]
    if case.scaler is not None:
        assert sum(truth["skipped"]) == len(OVERFLOW_STEPS)  # rank 1's overflows skip both
        assert [wire.decode_float(s["loss_scale"]) for s in steps] == truth["loss_scale"]
    for got, want in zip(steps, truth["loss"], strict=True):
        assert _close(got["loss"], want), (got["step"], got["loss"], want)

    findings = {
        e["data"]["code"]: e["data"] for r in (0, 1) for e in sent[r]["events"]
        if e["kind"] == "finding"
    }  # fmt: skip
    if parts:
        # Combined on the collector from both ranks' sums of squares: FSDP2, the norm of
        # the full tensors (`.full_tensor()`) every step; FSDP1's flat parameters (padded
        # shards), the test's own all-reduce of every shard's squares.
        stored = _stored_grad_norms(folder, sqlite_url)
        assert sorted(stored) == list(range(1, STEPS + 1))
        for step, want in enumerate(truth["grad_norm"], start=1):
            assert _close(stored[step], want), (step, stored[step], want)
        assert "grad_norm_sharded" not in findings
    elif case.clip or not sharded:
        # The loop's own clip (or, replicated under DDP, one pass of the agent's): the
        # global norm over every shard, step by step.
        for got, want in zip(steps, truth["grad_norm"], strict=True):
            assert _close(got["grad_norm"], want), (got["step"], got["grad_norm"], want)
        assert "grad_norm_sharded" not in findings
    if case.clip:
        for got, total in zip(steps, truth["clip_total"], strict=True):
            assert _close(got["grad_norm"], total)

    start = next(e for e in sent[0]["events"] if e["kind"] == "run_start")["data"]
    assert start["sharding"] == (case.wrap if sharded else None)
    assert start["shard_replicas"] == (case.replicas if sharded else None)
    if sharded:  # the shards are fp32; the wrapper's policy computes in case.dtype
        bf16 = str(case.dtype) == "torch.bfloat16"
        assert start["precision"] == ("bf16" if bf16 else "fp16")
        if bf16:
            assert findings["bf16_in_use"]["source"] == "fsdp_mixed_precision"
    layers = [_gradient_layers(sent[r]["layer_stats"]) for r in (0, 1)]
    for rank in (0, 1):
        assert [r["step"] for r in layers[rank]] == list(range(1, STEPS + 1, EVERY))
    if not case.orig_params:
        assert "flat_params" in findings
        assert all(n.endswith("_flat_param") for n in layers[0][0]["names"])
        return
    expected_names = USER_NAMES if case.final_norm else NO_NORM_NAMES
    for rank in (0, 1):
        assert set(layers[rank][0]["names"]) <= expected_names  # no wrapper prefixes
    fp8 = [r for r in sent[0]["layer_stats"] if r not in layers[0]]
    assert fp8 and all(not n.startswith("_") for r in fp8 for n in r["names"])
    _assert_layers_combine(case, layers, truth)


def _assert_layers_combine(
    case: Any, layers: list[list[dict[str, Any]]], truth: dict[str, Any]
) -> None:
    """Per rank, each layer record is that rank's shard: summed over ranks, zero counts
    give the full gradient's; max|g·S| is the larger rank's. Under DDP each rank holds the
    whole (all-reduced) gradient."""
    shard_numels = _shard_numels(case)
    for index, step in enumerate(range(1, STEPS + 1, EVERY)):
        full = truth["layers"][str(step)]
        zeros: dict[str, float] = {}
        peaks: dict[str, float] = {}
        for rank in (0, 1):
            record = layers[rank][index]
            stats = record["stats"]
            for i, name in enumerate(record["names"]):
                whole = case.replicas > 1  # DDP, NO_SHARD: each rank the whole gradient
                numel = full[name][1] if whole else shard_numels[rank][name]
                share = stats["zero_fraction"][i] * numel
                zeros[name] = share if whole else zeros.get(name, 0.0) + share
                peak = wire.decode_float(stats["max_abs_scaled"][i])
                assert peak is not None
                peaks[name] = max(peaks.get(name, -1.0), peak)
        assert set(zeros) == set(full), step
        for name, (zero, _, peak, *_) in full.items():
            assert round(zeros[name]) == zero, (step, name)
            if math.isfinite(peak):
                assert peaks[name] == pytest.approx(peak, rel=1e-6), (step, name)


def _shard_numels(case: Any) -> list[dict[str, int]]:
    """Each rank's element count of every parameter: FSDP2 shards dim 0 (torch.chunk); FSDP1
    flattens each wrapped module's parameters in order and gives rank r the r-th half;
    under DDP and NO_SHARD every rank holds the whole."""
    model = TinyTransformer(case.final_norm)
    named = [(n, p.shape) for n, p in model.named_parameters()]
    if case.replicas > 1:
        return [{n: math.prod(shape) for n, shape in named}] * 2
    if case.wrap == "fsdp2":
        result: list[dict[str, int]] = [{}, {}]
        for name, shape in named:
            rows = shape[0]
            per = -(-rows // 2)
            inner = math.prod(shape[1:])
            result[0][name] = min(per, rows) * inner
            result[1][name] = max(0, rows - per) * inner
        return result
    groups: dict[str, list[tuple[str, int]]] = {}
    for name, shape in named:
        owner = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else ""
        groups.setdefault(owner, []).append((name, math.prod(shape)))
    result = [{}, {}]
    for members in groups.values():
        total = sum(n for _, n in members)
        half = -(-total // 2)
        start = 0
        for name, numel in members:
            for rank, (low, high) in enumerate(((0, half), (half, 2 * half))):
                result[rank][name] = max(0, min(start + numel, high) - max(start, low))
            start += numel
    return result


def _post_all(client: httpx.Client, folder: Path) -> int:
    """Both ranks' batches, as the agent sent them (gzip), rank 1's first; the run's id."""
    run_ids = set()
    for rank in (1, 0):
        for path in sorted(folder.glob(f"rank{rank}-*")):
            answer = client.post(
                wire.INGEST_PATH, content=path.read_bytes(),
                headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
            )  # fmt: skip
            assert answer.status_code == 200, answer.text
            run_ids.add(answer.json()["run_id"])
    (run_id,) = run_ids
    return int(run_id)


def test_full_layer_figures_combine_the_ranks_shards(
    matrix: Path, db_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> None:
    """`GET /runs/{id}/layers/full?step=` adds up the ranks' shard records into the full
    gradient's figures: numel, zero / subnormal / flush counts and max|g*S| equal those of
    the full tensors the loop gathered (`.full_tensor()`, `summon_full_params`), on every
    sampled step of every case with per-parameter names; under DDP, rank 0's record as is."""
    cases = [c for c in CASES if c.orig_params]
    with (
        start_collector(db_url, dashboard=False) as live,
        httpx.Client(base_url=live.url, timeout=60) as client,
    ):
        for case in cases:
            folder = matrix / case.name
            truth = json.loads((folder / "truth0.json").read_text())
            shard_numels = _shard_numels(case)
            run_id = _post_all(client, folder)
            for step in range(1, STEPS + 1, EVERY):
                answer = client.get(f"/api/v1/runs/{run_id}/layers/full", params={"step": step})
                assert answer.status_code == 200, answer.text
                got = answer.json()
                sharded = case.wrap != "ddp"
                assert got["step"] == step and got["ranks"] == ([0, 1] if sharded else [0])
                assert got["combined"] == ("shards" if sharded else "replicated")
                layers = {layer["layer"]: layer for layer in got["layers"]}
                full = truth["layers"][str(step)]
                assert set(layers) == set(full), (case.name, step)
                for name, (zero, numel, peak, subnormal, flush) in full.items():
                    layer, where = layers[name], (case.name, step, name)
                    held = sum(n[name] > 0 for n in shard_numels) if sharded else 1
                    assert layer["ranks"] == held, where  # FSDP1: some whole on one rank
                    assert layer["numel"] == numel == sum(layer["counts"]), where
                    assert layer["zero_count"] == zero, where
                    for stat, count in (
                        ("subnormal_fraction", subnormal),
                        ("flush_fraction", flush),
                    ):
                        assert round(wire.decode_float(layer[stat]) * numel) == count, where
                    top = wire.decode_float(layer["max_abs_scaled"])
                    assert top is not None, where
                    if math.isfinite(peak):
                        assert top == pytest.approx(peak, rel=1e-6), where
                    else:  # an overflow step: NaN where the full tensor has one, else Inf
                        assert math.isnan(top) == math.isnan(peak) and not math.isfinite(top)
        # Bounded answers on bad input, naming nothing it was sent.
        latest = client.get(f"/api/v1/runs/{run_id}/layers/full")
        assert latest.status_code == 200 and latest.json()["step"] == 5
        for params, status in (({"step": 2}, 404), ({"step": -1}, 422), ({"step": "x1y"}, 422),
                               ({"step": 2**70}, 422)):  # fmt: skip
            answer = client.get(f"/api/v1/runs/{run_id}/layers/full", params=params)
            assert answer.status_code == status and "x1y" not in answer.text, params
        assert client.get("/api/v1/runs/999999/layers/full").status_code == 404
