"""The sharded-training matrix, run in each of 2 gloo CPU processes (`mp.spawn` from
test_sharded.py): every case trains a tiny transformer twice, without the agent and with
it, and writes what the agent sent (`<out>/<case>/rank<r>-NNNN`), the truth the loop
computed independently (`<out>/<case>/truth<r>.json`: full tensors gathered with
`.full_tensor()` / `summon_full_params`, the optimizer's step counter, the scaler's scale)
and whether both trainings ended bit-identical.

One process launch runs every case: a spawn costs seconds, a case a fraction of one.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ampwatch.agent import watch

STEPS = 6
EVERY = 2  # layer statistics at steps 1, 3, 5
VOCAB, DIM = 64, 16
#: Steps at which rank 1 alone overflows (cases with a scaler).
OVERFLOW_STEPS = (3, 5)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


class TinyTransformer(nn.Module):
    """Embedding, two blocks, a final LayerNorm (or none), a head."""

    def __init__(self, final_norm: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm: nn.Module = nn.LayerNorm(DIM) if final_norm else nn.Identity()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@dataclass(frozen=True)
class Case:
    name: str
    wrap: str  # fsdp2, fsdp1, ddp
    dtype: torch.dtype
    clip: bool = False
    final_norm: bool = True
    scaler: str | None = None  # "amp", "sharded"
    orig_params: bool = True  # FSDP1
    #: FSDP1's ShardingStrategy; HYBRID_SHARD on a (1 replica group x 2 ranks) mesh.
    #: FSDP2: "HSDP" on a (2 replicas x 1 rank) mesh.
    strategy: str = "FULL_SHARD"

    @property
    def replicas(self) -> int:
        """On how many of the 2 ranks each local gradient is held whole and identical."""
        return 2 if self.wrap == "ddp" or self.strategy in ("NO_SHARD", "HSDP") else 1


CASES = (
    Case("fsdp2_bf16", "fsdp2", torch.bfloat16),
    Case("fsdp2_bf16_nonorm_clip", "fsdp2", torch.bfloat16, clip=True, final_norm=False),
    Case("fsdp2_fp16_scaler", "fsdp2", torch.float16, clip=True, scaler="amp"),
    Case("fsdp1_fp16_sharded_scaler", "fsdp1", torch.float16, clip=True, scaler="sharded"),
    Case("fsdp1_bf16_flat", "fsdp1", torch.bfloat16, orig_params=False),  # no clip: parts
    Case("fsdp1_bf16_no_shard", "fsdp1", torch.bfloat16, strategy="NO_SHARD"),  # parts / 2
    Case("fsdp1_bf16_hybrid", "fsdp1", torch.bfloat16, strategy="HYBRID_SHARD"),
    Case("fsdp2_bf16_hsdp", "fsdp2", torch.bfloat16, strategy="HSDP"),  # parts / 2
    Case("ddp_fp16", "ddp", torch.float16, scaler="amp"),
)


def _wrap(case: Case, model: nn.Module) -> nn.Module:
    if case.wrap == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=case.dtype, reduce_dtype=torch.float32)
        mesh = None
        if case.strategy == "HSDP":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model
    if case.wrap == "fsdp1":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (
            FullyShardedDataParallel,
            MixedPrecision,
            ShardingStrategy,
        )
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        hybrid = case.strategy == "HYBRID_SHARD"
        mesh = (
            init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
            if hybrid
            else None
        )
        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            mixed_precision=MixedPrecision(param_dtype=case.dtype, reduce_dtype=torch.float32),
            use_orig_params=case.orig_params,
            device_id=torch.device("cpu"),
            sharding_strategy=getattr(ShardingStrategy, case.strategy),
            device_mesh=mesh,
        )
    return nn.parallel.DistributedDataParallel(model)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    local = getattr(tensor, "to_local", None)
    return (local() if callable(local) else tensor).detach()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


def _grad_truth(
    case: Case, model: nn.Module, names: list[str], sampled: bool, scale: float
) -> dict[str, Any]:
    """The global norm and, on `sampled` steps, per parameter, zero count / numel / max|g| /
    subnormal and flush counts of |g * scale| (wire `LAYER_STATS`) of the whole gradient,
    from full tensors (the test's own collectives, on every rank).
    FSDP2 without a clip gathers full tensors every step: the collector's combined norm
    is checked against them."""
    whole = sampled or (case.wrap == "fsdp2" and not case.clip)
    if case.wrap != "ddp" and not (case.orig_params and whole):
        # The squares of every rank's shard, all-reduced by the test (FSDP1 pads the last
        # shard with zeros, which add nothing; NO_SHARD: every rank's is the whole, counted
        # once); gathering whole tensors is for sampled steps.
        local = [_local(p.grad).float() for p in model.parameters() if p.grad is not None]
        squares = torch.stack([g.pow(2).sum() for g in local]).sum()
        dist.all_reduce(squares)
        return {"norm": math.sqrt(float(squares) / case.replicas), "layers": None}
    if case.wrap == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, with_grads=True):
            grads = [p.grad.detach().float().clone() for p in model.parameters()]
    else:
        grads = [_full(p.grad).detach().float() for p in model.parameters()]
    norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
    layers = {name: _counts(g, scale) for name, g in zip(names, grads, strict=True)}
    return {"norm": norm, "layers": layers}


def _counts(grad: torch.Tensor, scale: float) -> list[float]:
    """[zeros, numel, max|g|, subnormal count, flush count] of one whole gradient, the last
    two of |g * scale| in float64 (FP16's subnormal range [2^-24, 2^-14), below it)."""
    scaled = grad.double().abs() * scale
    subnormal = int(((scaled >= 2.0**-24) & (scaled < 2.0**-14)).sum())
    flush = int(((scaled > 0) & (scaled < 2.0**-24)).sum())
    return [int((grad == 0).sum()), grad.numel(), float(grad.abs().max()), subnormal, flush]


def _train(
    case: Case, rank: int, out: Path | None, truth: dict[str, Any] | None
) -> list[torch.Tensor]:
    """Train STEPS steps; with `out`, under the agent. Returns the full final parameters."""
    torch.manual_seed(0)
    model = _wrap(case, TinyTransformer(case.final_norm))
    names = [n for n, _ in TinyTransformer(case.final_norm).named_parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler: torch.amp.GradScaler | None = None
    if case.scaler == "sharded":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    elif case.scaler == "amp":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    handle = None
    if out is not None:
        sent = iter(range(1_000_000))

        def transport(body: bytes, headers: dict[str, str]) -> int:
            (out / f"rank{rank}-{next(sent):04d}").write_bytes(body)
            return 200

        handle = watch(
            model, optimizer, scaler, transport=transport, run=case.name,
            layer_stats_every=EVERY, fp8_stats_every=4, flush_interval=0.05,
        )  # fmt: skip
    data = torch.Generator().manual_seed(100 + rank)
    for step in range(1, STEPS + 1):
        tokens = torch.randint(0, VOCAB, (4, 12), generator=data)
        with torch.autocast("cpu", dtype=case.dtype, enabled=case.wrap == "ddp"):
            logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        if scaler is None and handle is not None:
            handle.log_loss(loss)
        if truth is not None:
            truth["loss"].append(float(loss))
        overflow = scaler is not None and rank == 1 and step in OVERFLOW_STEPS
        if scaler is not None:
            truth_scale = float(scaler.get_scale())
            scaled = scaler.scale(loss)
            if overflow and case.scaler == "amp":  # rank 1's loss overflows: the gradient
                scaled = scaled * math.inf  # reduction carries it to every rank
            scaled.backward()
            if overflow and case.scaler == "sharded":
                # Rank 1's own shard overflows after the reduce-scatter: ShardedGradScaler
                # all-reduces its found-inf flags, so rank 0 skips the step too.
                shard = next(p.grad for p in model.parameters() if p.grad is not None)
                shard.view(-1)[0] = math.inf
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        if truth is not None:
            scale = truth_scale if scaler is not None else 1.0
            grads = _grad_truth(case, model, names, (step - 1) % EVERY == 0, scale)
            truth["grad_norm"].append(grads["norm"])
            if grads["layers"] is not None and (step - 1) % EVERY == 0:
                truth["layers"][step] = {
                    n: [z, c, m * scale, *rest] for n, (z, c, m, *rest) in grads["layers"].items()
                }
            truth["loss_scale"].append(scale if scaler is not None else None)
        if case.clip:
            if case.wrap == "fsdp1":
                total = model.clip_grad_norm_(1.0)  # type: ignore[operator]
            else:
                total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if truth is not None:
                truth["clip_total"].append(float(_full(total)))
        before = _step_count(optimizer)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if truth is not None:
            truth["skipped"].append(_step_count(optimizer) == before)
        optimizer.zero_grad()
    if handle is not None:
        handle.detach()
        assert handle.counters["hook_errors"] == 0, handle.counters
    return _final_params(case, model)


def _step_count(optimizer: torch.optim.Optimizer) -> float:
    """AdamW's step counter: it does not move on a step the scaler skipped."""
    return max((float(s["step"]) for s in optimizer.state.values()), default=0.0)


def _final_params(case: Case, model: nn.Module) -> list[torch.Tensor]:
    if case.wrap == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            return [p.detach().clone() for p in model.parameters()]
    return [_full(p).detach().clone() for p in model.parameters()]


def run_cases(rank: int, world_size: int, init_file: str, out: str) -> None:
    """The `mp.spawn` target: every case, in order, on this rank."""
    warnings.simplefilter("ignore")
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        for case in CASES:
            folder = Path(out) / case.name
            folder.mkdir(exist_ok=True)
            baseline = _train(case, rank, None, None)
            truth: dict[str, Any] = {
                k: [] for k in ("loss", "grad_norm", "loss_scale", "clip_total", "skipped")
            }
            truth["layers"] = {}
            watched = _train(case, rank, folder, truth)
            truth["identical"] = all(
                torch.equal(a, b) for a, b in zip(baseline, watched, strict=True)
            )
            (folder / f"truth{rank}.json").write_text(json.dumps(truth))
            dist.barrier()
    finally:
        dist.destroy_process_group()
