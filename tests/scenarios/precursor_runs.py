"""Tiny trainings that diverge the way large runs do, and healthy twins, for the
early-warning bench (`bench/detection.py --precursors`, issue 32).

Each run is a real CPU training of a tiny transformer built from a `Config` (embedding,
pre-norm attention + MLP blocks, final norm, head), AdamW, with `watch()` streaming into a
collector. Families:

- `wortsman`: a high lr with a long-memory second moment (beta2 0.999) and a warm-up of a few
  steps: the second moment lags the gradients (Wortsman et al. 2023's setting);
- `short_warmup`: a high lr reached in 2 steps;
- `poison`: a stretch of the data stream whose targets ramp to noise and back;
- `overflow`: FP16 autocast with a real GradScaler while the lr grows every step: the
  overflow cascade that drives the scale down before the loss goes non-finite;
- `underflow`: FP16 autocast without a scaler, the loss normaliser growing every step
  (gradient accumulation growing), so layer gradients flush to zero one after another;
- `healthy`: the same model and data at a sane lr and warm-up (FP32, and FP16 with a
  scaler).

The event step is defined from the training alone, not from ampwatch (`event_of`): the
first non-finite loss, the first loss above `SPIKE_FACTOR` x the median of its last
`SPIKE_WINDOW` finite losses, or the first step a parameter's gradient is >= 95% exactly
zero (checked every step in the loop). Seeds below `HELD_OUT_FROM` are the tuning set; the
others are only measured.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampwatch.agent import watch

SPIKE_FACTOR = 2.0
SPIKE_WINDOW = 50
SPIKE_WARMUP = 20
FROZEN = 0.95
HELD_OUT_FROM = 100
BASE_NOISE = 0.3
#: Steps trained after the event (then the run ends: a peer that flags later is late).
AFTER_EVENT = 15
VOCAB, SEQ, BATCH = 64, 16, 8


@dataclass(frozen=True)
class Config:
    family: str
    seed: int
    steps: int = 240
    width: int = 16
    depth: int = 2
    lr: float = 3e-3
    warmup: int = 50
    beta2: float = 0.95
    dtype: str = "fp32"  # or fp16 (autocast)
    scaler: bool = False
    lr_growth: float = 1.0  # x per step from `grow_from`
    grow_from: int = 60
    poison: tuple[int, int] = (0, 0)  # steps of the poisoned stretch
    divisor_growth: float = 1.0  # the loss normaliser's growth per step from `grow_from`
    layer_stats_every: int = 5

    @property
    def name(self) -> str:
        return f"{self.family}-s{self.seed}"

    @property
    def held_out(self) -> bool:
        return self.seed >= HELD_OUT_FROM

    @property
    def healthy(self) -> bool:
        return self.family.startswith("healthy")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, num_heads=2, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.randn(SEQ, width) * 0.02)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.emb(tokens) + self.pos)))


def _batches(seed: int) -> Callable[[int, float], tuple[torch.Tensor, torch.Tensor]]:
    """A learnable task (next token of a fixed random permutation chain, with noise);
    `noise` in [0, 1] replaces that share of the targets by random tokens."""
    g = torch.Generator().manual_seed(seed)
    chain = torch.randperm(VOCAB, generator=g)
    paths = [torch.arange(VOCAB)]
    for _ in range(SEQ):
        paths.append(chain[paths[-1]])
    walks = torch.stack(paths, dim=1)  # the walk of SEQ + 1 tokens from each token

    def batch(step: int, noise: float) -> tuple[torch.Tensor, torch.Tensor]:
        seq = walks[torch.randint(0, VOCAB, (BATCH,), generator=g)]
        x, y = seq[:, :-1], seq[:, 1:].clone()
        noise = max(noise, BASE_NOISE)  # an irreducible loss: gradients keep a noise floor
        if noise > 0:
            mask = torch.rand(y.shape, generator=g) < noise
            y[mask] = torch.randint(0, VOCAB, (int(mask.sum()),), generator=g)
        return x, y

    return batch


@dataclass
class Trained:
    config: Config
    client_run_id: str
    losses: list[float] = field(default_factory=list)  # per step, from 1
    frozen_step: int | None = None  # first step a parameter's gradient was >= 95% zero
    wall: float = 0.0

    @property
    def event(self) -> tuple[int, str] | None:
        return event_of(self.losses, self.frozen_step)


def event_of(losses: list[float], frozen_step: int | None) -> tuple[int, str] | None:
    """The first step of a non-finite loss, a loss spike (SPIKE_FACTOR x the median of the
    last SPIKE_WINDOW finite losses, after SPIKE_WARMUP steps) or a frozen layer."""
    finite: list[float] = []
    found: tuple[int, str] | None = None
    for i, loss in enumerate(losses):
        step = i + 1
        if not math.isfinite(loss):
            found = (step, "non-finite loss")
            break
        if len(finite) >= SPIKE_WARMUP and loss > SPIKE_FACTOR * statistics.median(
            finite[-SPIKE_WINDOW:]
        ):
            found = (step, "loss spike")
            break
        finite.append(loss)
    if frozen_step is not None and (found is None or frozen_step < found[0]):
        return frozen_step, "layer >= 95% zero"
    return found


def _noise(config: Config, step: int) -> float:
    """The poisoned stretch: targets ramp to noise over its first half and back."""
    start, end = config.poison
    if not start <= step < end:
        return 0.0
    half = max((end - start) // 2, 1)
    return min(1.0, (step - start + 1) / half) if step < start + half else 1.0


def train(config: Config, url: str) -> Trained:
    """Run `config` with the agent streaming into the collector at `url`."""
    import time

    torch.manual_seed(config.seed)
    model = TinyTransformer(config.width, config.depth)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=(0.9, config.beta2), weight_decay=0.0
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if config.scaler else None
    batch = _batches(config.seed)
    loss_fn = nn.CrossEntropyLoss()
    fp16 = config.dtype == "fp16"
    started = time.monotonic()
    with watch(model, optimizer, scaler, run=config.name, project="precursors", url=url,
               layer_stats_every=config.layer_stats_every, flush_interval=0.5) as handle:  # fmt: skip
        out = Trained(config, handle.client_run_id)
        for step in range(1, config.steps + 1):
            warm = min(1.0, step / max(config.warmup, 1))
            grow = config.lr_growth ** max(step - config.grow_from, 0)
            for group in optimizer.param_groups:
                group["lr"] = config.lr * warm * grow
            x, y = batch(step, _noise(config, step))
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                logits = model(x)
            loss = loss_fn(logits.float().reshape(-1, VOCAB), y.reshape(-1))
            out.losses.append(float(loss.detach()))
            handle.log_loss(loss.detach())
            divisor = config.divisor_growth ** max(step - config.grow_from, 0)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                (loss / divisor).backward()
                if out.frozen_step is None and _frozen(model):
                    out.frozen_step = step
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if (event := out.event) is not None and step >= event[0] + AFTER_EVENT:
                break  # every rule, peer or ours, has had its chance at the event
        out.wall = time.monotonic() - started
    return out


def _frozen(model: nn.Module) -> bool:
    return any(
        p.grad is not None and p.grad.numel() > 16 and float((p.grad == 0).float().mean()) >= FROZEN
        for p in model.parameters()
    )


def configs(seeds: list[int]) -> list[Config]:
    """The diverging families and the healthy twins for each seed (module docstring)."""
    out: list[Config] = []
    for seed in seeds:
        v = seed % 3
        out += [
            Config(
                "wortsman", seed, lr=0.01, beta2=0.999, warmup=5, lr_growth=(1.03, 1.04, 1.05)[v]
            ),
            Config(
                "short_warmup",
                seed,
                lr=(0.01, 0.02, 0.03)[v],
                warmup=2,
                beta2=0.99,
                lr_growth=1.03,
                grow_from=80,
            ),
            Config("poison", seed, poison=(100, 100 + (20, 30, 40)[v]), lr=3e-3),
            Config(
                "overflow",
                seed,
                dtype="fp16",
                scaler=True,
                lr=3e-3,
                lr_growth=(1.04, 1.05, 1.06)[v],
            ),
            Config(
                "underflow",
                seed,
                dtype="fp16",
                depth=(1, 2, 3)[v],
                lr=3e-3,
                divisor_growth=(1.15, 1.25, 1.4)[v],
                grow_from=40,
            ),
            Config("healthy", seed, lr=(1e-3, 2e-3, 3e-3)[v]),
            Config("healthy_b2", seed, lr=2e-3, beta2=0.999, warmup=20),
            Config("healthy_fp16", seed, dtype="fp16", scaler=True, lr=2e-3),
            Config("healthy_deep", seed, depth=3, lr=1e-3),
            Config("healthy_wide", seed, width=24, lr=1.5e-3),
        ]
    return out


def kill_loss_spike(losses: list[tuple[int, float]], total_steps: int,
                    patience: int = 4, factor: float = 2.0) -> list[int]:  # fmt: skip
    """llm-foundry's KillLossSpike (peer-detectors.md): a loss is an outlier at >= `factor`
    x the mean of the window (max(100, 5% of the batches)) once the window is full; a spike
    after `patience` consecutive outliers (flagged on the next, the patience+1-th)."""
    window = max(100, total_steps // 20)
    recent: list[float] = []
    streak = 0
    out = []
    for step, loss in losses:
        if not math.isfinite(loss):
            continue
        if len(recent) >= window:
            if loss >= factor * statistics.fmean(recent[-window:]):
                streak += 1
                if streak > patience:
                    out.append(step)
            else:
                streak = 0
        recent.append(loss)
    return out


# -- measuring: ampwatch's alerts and the peers' first flags, side by side -------------------

PEER_NAMES = ("megatron_10x", "olmo_6sigma", "fabric_spike", "kill_loss_spike")


@dataclass
class Measured:
    trained: Trained
    alerts: list[dict[str, Any]]
    peers: dict[str, int | None]

    @property
    def fired(self) -> list[dict[str, Any]]:
        """Fired alerts of incident rules (configuration findings, true from step 1 of an
        FP16 run without a scaler, say nothing of when: left out)."""
        from ampwatch.server.alerts.rules import CONFIGURATION_RULES

        return [a for a in self.alerts if a.get("fired_step") is not None
                and a["rule"] not in CONFIGURATION_RULES]  # fmt: skip

    def first(self, severity: str | None = None) -> int | None:
        steps = [int(a["fired_step"]) for a in self.fired
                 if severity is None or a["severity"] == severity]  # fmt: skip
        return min(steps, default=None)

    def first_critical(self) -> int | None:
        # an escalated alert keeps its fired step: its critical came no earlier
        return self.first("critical")

    @property
    def lead(self) -> int | None:
        event, first = self.trained.event, self.first()
        return None if event is None or first is None else event[0] - first

    def leads_every_peer(self) -> bool:
        lead, first = self.lead, self.first()
        if lead is None or first is None or lead < 0:
            return False
        return all(p is None or first < p for p in self.peers.values())


def peer_flags(trained: Trained) -> dict[str, int | None]:
    """The first step each peer's rule flags on the run's loss series (`real_logs`' rules,
    the same ones the real-log bench runs, and llm-foundry's `kill_loss_spike`)."""
    from types import SimpleNamespace

    import real_logs

    steps: Any = [SimpleNamespace(step=i + 1, loss=v, loss_scale=None, grad_norm=None)
                  for i, v in enumerate(trained.losses)]  # fmt: skip
    pairs = [(i + 1, v) for i, v in enumerate(trained.losses)]
    flags = {
        "megatron_10x": real_logs.megatron_spiky_loss(steps),
        "olmo_6sigma": real_logs.olmo_core_spike(steps),
        "fabric_spike": real_logs.lightning_spike(steps),
        "kill_loss_spike": kill_loss_spike(pairs, trained.config.steps),
    }
    # Non-finite losses: Megatron's rerun machine and Fabric's detector both stop on NaN.
    nan = next((i + 1 for i, v in enumerate(trained.losses) if not math.isfinite(v)), None)
    for name in ("megatron_10x", "fabric_spike"):
        if nan is not None:
            flags[name] = sorted([*flags[name], nan])
    return {name: (min(f) if f else None) for name, f in flags.items()}


def measure(config: Config, url: str) -> Measured:
    import httpx
    from scenario_catalog import find_run
    from scenario_judge import read_alerts

    trained = train(config, url)
    with httpx.Client(base_url=url, timeout=30) as api:
        run = find_run(api, trained.client_run_id)
        alerts = read_alerts(api, run["id"])
    return Measured(trained, alerts, peer_flags(trained))


def row(m: Measured) -> str:
    c, event = m.trained.config, m.trained.event
    peers = " ".join(f"{p}={m.peers[p] if m.peers[p] is not None else '-'}" for p in PEER_NAMES)
    rules = ",".join(sorted({f"{a['rule']}@{a['fired_step']}" for a in m.fired})) or "-"
    shown = f"{event[0]} ({event[1]})" if event else "none"
    return (f"{c.name:<18} {'held' if c.held_out else 'tune'} {m.trained.wall:4.1f}s "
            f"event {shown:<28} "
            f"warn {m.first() or '-'} crit {m.first_critical() or '-'} lead {m.lead}  "
            f"{peers}  [{rules}]")  # fmt: skip


def summary(measured: list[Measured], label: str) -> tuple[list[str], dict[str, bool]]:
    """The bars' figures for one set of runs (tuning or held out)."""
    diverged = [m for m in measured if not m.trained.config.healthy and m.trained.event]
    quiet = [m for m in measured if m.trained.config.healthy]
    leads = [m.lead if m.lead is not None else -(10**9) for m in diverged]
    # a run with no warning by its event counts as a miss (lead below every bar)
    median = statistics.median(leads) if leads else None
    ahead = sum(m.leads_every_peer() for m in diverged)
    one = sum(1 for v in leads if v >= 1)
    healthy_steps = sum(len(m.trained.losses) for m in quiet)
    warnings = sum(1 for m in quiet for a in m.fired)
    criticals = sum(1 for m in quiet for a in m.fired if a["severity"] == "critical")
    healthy_events = sum(1 for m in quiet if m.trained.event)
    underflow = [m for m in diverged if m.trained.config.family == "underflow"]
    before_freeze = sum(
        1 for m in underflow
        if m.trained.frozen_step is not None and (f := m.first()) is not None
        and f < m.trained.frozen_step
    )  # fmt: skip
    no_event = [m.trained.config.name for m in measured
                if not m.trained.config.healthy and not m.trained.event]  # fmt: skip
    n = max(len(diverged), 1)
    rate = warnings / healthy_steps * 10_000 if healthy_steps else 0.0
    shown_median = "-" if median is None else ("miss" if median < -(10**8) else median)
    lines = [
        f"{label}: {len(diverged)} diverging runs with an event, {len(quiet)} healthy "
        f"({healthy_steps} steps; {healthy_events} of them with an event by the definition); "
        f"designed to diverge but no event: {len(no_event)} {no_event}",
        f"  median lead of the first warning: {shown_median} steps (bar >= 3)",
        f"  ahead of every peer: {ahead}/{len(diverged)} = {ahead / n:.0%} (bar >= 80%)",
        f"  >= 1 step of lead: {one}/{len(diverged)} = {one / n:.0%} (bar >= 60%)",
        f"  false warnings on healthy: {warnings} = {rate:.2f} per 10k steps (bar <= 1); "
        f"criticals: {criticals} (bar 0)",
        f"  underflow runs warned before the first layer >= 95% zero: "
        f"{before_freeze}/{len(underflow)} (bar: all)",
    ]
    for family in sorted({m.trained.config.family for m in diverged}):
        runs = [m for m in diverged if m.trained.config.family == family]
        fl = [m.lead for m in runs]
        lines.append(f"    {family}: leads {fl}")
    bars = {
        "median lead": median is not None and median >= 3,
        "ahead of peers": ahead >= 0.8 * len(diverged),
        "one step": one >= 0.6 * len(diverged),
        "healthy warnings": rate <= 1.0,
        "healthy criticals": criticals == 0,
        "underflow": before_freeze == len(underflow),
    }
    return lines, bars
