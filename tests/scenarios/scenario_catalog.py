"""The scenario catalog: real mixed-precision training runs on the CPU, each labeled.

Every scenario trains a tiny model for a few hundred steps with real autocast (FP16 or
BF16), a real `torch.amp.GradScaler` where it has one, and the real agent streaming into a
real collector over HTTP. Nothing here fabricates a series: the failures come from the
training itself (a learning rate that keeps climbing, a loss normalised by a global token
count so FP16 gradients flush to zero, a poisoned batch, clipping in the wrong order).

A scenario's `Label` has two halves:

- what a human decided before the run: which rules must fire, which must not, which
  severities must stay silent, which rules may fire without counting as false alerts;
- ground truth measured from the run's own data once it is stored (`ground_truth`): the
  step the loss scale first fell below 1.0, the step the final-layer activation norm
  began to rise (the precursor), the first step a layer froze, and the healthy restart
  checkpoint (the last one at least `LABEL_MARGIN` steps before the precursor, with the
  scale >= 1.0 there). These are computed, never typed in, so a change of torch or seed
  moves them with the data.

`scenario_judge.py` runs a scenario against a collector and judges its alerts and restart
advice against the label. `tests/scenarios/test_scenarios.py` (pytest) and
`bench/detection.py` both import these two modules by file name: pytest puts
`tests/scenarios/` on `sys.path` for the test module beside it (rootdir-relative
"prepend" import, as `tests/agent/agent_fakes.py` is found), and the bench inserts that
folder itself. `tests/` has no `__init__.py`, so this keeps the
repository's one convention instead of inventing a `tests` package.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import torch
from torch import nn

from ampwatch.agent import watch
from ampwatch.server.demo import VOCAB, synthetic_batches, tiny_lm

BIG_VOCAB = 16_384
#: Rule names of the alert engine's API contract.
RULES = (
    "loss_scale_collapse",
    "skip_rate",
    "activation_norm_spike",
    "silent_underflow",
    "underflow_risk",
    "scale_floor_stall",
    "no_data",
    "nan_loss",
    "fp16_without_scaler",
    "clip_before_unscale",
    "loss_spike",
    "grad_norm_spike",
    "overflow_burst",
    "fp8_risk",
    "update_rms_rise",
    "scale_decline",
    "flush_trend",
    "loss_collapse",
)
#: A labeled restart checkpoint precedes the precursor's onset by at least this many steps.
#: The onset here is ground truth (where the rise began, at a 5% deviation), not a
#: detector's firing step, so the margin only covers a rise's first sub-5% steps; the
#: advisor's own margin (20 by default) also absorbs its detection delay.
LABEL_MARGIN = 10
#: Sampling of per-layer statistics in every scenario (the agent's default is 20).
LAYER_STATS_EVERY = 5
#: The activation-norm precursor (ground truth): the first step from which the final
#: layer's mean activation norm stays above PRECURSOR_FACTOR x its own rolling baseline
#: (the median of the steps BASELINE_LAG[1]..BASELINE_LAG[0] before it) for
#: PRECURSOR_SUSTAIN consecutive steps (a non-finite norm counts as above).
#: Where that rise began (`Label.precursor_step`): the first step of the unbroken stretch,
#: ending at the detection, in which the norm stays above PRECURSOR_BEGIN x the baseline
#: the detection was measured against.
PRECURSOR_FACTOR = 1.5
PRECURSOR_SUSTAIN = 5
PRECURSOR_BEGIN = 1.05
BASELINE_LAG = (10, 60)


@dataclass(frozen=True)
class Label:
    """What must and must not happen in a scenario; the `*_step` fields and
    `healthy_checkpoint` are filled from the stored data by `ground_truth`."""

    must_fire: frozenset[str] = frozenset()
    must_not_fire: frozenset[str] = frozenset()
    #: No alert of these severities may fire unless its rule is in must_fire / may_fire.
    must_not_fire_severity: frozenset[str] = frozenset({"critical"})
    #: Rules that may fire here without counting as false alerts (consequences of the
    #: labeled failure, e.g. skip_rate during a collapse).
    may_fire: frozenset[str] = frozenset()
    #: The collapse alert must fire before the scale falls below 1.0 (a precursor exists).
    collapse_before_floor: bool = False
    #: The restart advisor's recommendation is checked against `healthy_checkpoint`.
    check_advisor: bool = False
    #: underflow_risk (the forecast) must fire before the first layer freezes.
    forecast_before_freeze: bool = False
    # --- ground truth, measured from the run ---------------------------------------------
    collapse_step: int | None = None  # first step with loss_scale < 1.0
    precursor_step: int | None = None  # onset of the activation-norm rise
    first_frozen_step: int | None = None  # first sampled step a learning layer is all-zero
    healthy_checkpoint: int | None = None  # the step of the labeled restart checkpoint


@dataclass(frozen=True)
class Knobs:
    """How one scenario's training loop differs from the healthy FP16 loop."""

    steps: int = 240
    dtype: torch.dtype = torch.float16
    scaler: dict[str, Any] | None = field(
        default_factory=lambda: {"init_scale": 2.0**32, "growth_interval": 100}
    )
    vocab_in: int = VOCAB
    lr: float = 1e-3
    lr_growth: float = 1.0  # per-step factor on the learning rate ...
    lr_growth_from: int = 1  # ... from this step on (a schedule gone wrong)
    #: (step from which it applies, divisor): the loss is divided by a global token count.
    loss_divisor: tuple[int, float] = (1, 1.0)
    #: ... multiplied by this factor per step from then on (a normaliser that keeps growing).
    loss_divisor_growth: float = 1.0
    overflow_steps: frozenset[int] = frozenset()  # loss x 1e30 at these steps
    nan_steps: frozenset[int] = frozenset()  # a NaN in the input embeddings at these steps
    clip_scaled: bool = False  # clip_grad_norm_ before scaler.unscale_ (the bug)
    checkpoint_every: int = 0


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    knobs: Knobs
    label: Label
    #: Checks that the training produced the intended raw signals; returns problems.
    check_signals: Callable[[Observed, Label], list[str]]


# --- the model and the data: the demo's (`ampwatch.server.demo`) ---------------------------


def train(scenario: Scenario, url: str, checkpoint_dir: Path, *, seed: int = 0) -> str:
    """Train `scenario` with the agent attached to the collector at `url`; return the run's
    client id once the agent has detached (run_end sent, batches flushed)."""
    k = scenario.knobs
    torch.set_num_threads(1)
    model = tiny_lm(seed, k.vocab_in)
    optimizer = torch.optim.AdamW(model.parameters(), lr=k.lr)
    scaler = None if k.scaler is None else torch.amp.GradScaler("cpu", **k.scaler)
    loss_fn = nn.CrossEntropyLoss()
    data = synthetic_batches(seed, k.vocab_in)
    poison = {"on": False}

    def nan_hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        if poison["on"]:
            output = output.clone()
            output[0, 0, 0] = float("nan")  # one corrupted value in the batch
            return output
        return None

    model.emb.register_forward_hook(nan_hook)
    with watch(
        model,
        optimizer,
        scaler,
        run=scenario.name,
        project="scenarios",
        url=url,
        layer_stats_every=LAYER_STATS_EVERY,
        flush_interval=0.2,
    ) as handle:
        for step in range(1, k.steps + 1):
            tokens, targets = next(data)
            for group in optimizer.param_groups:
                group["lr"] = k.lr * k.lr_growth ** max(step - k.lr_growth_from, 0)
            poison["on"] = step in k.nan_steps
            with torch.autocast("cpu", dtype=k.dtype):
                logits = model(tokens)
            loss = loss_fn(logits.float().view(-1, VOCAB), targets.view(-1))
            if scaler is None:
                handle.log_loss(loss.detach())
            if step in k.overflow_steps:
                loss = loss * 1e30  # finite in FP32; its FP16 gradients overflow to Inf
            if step >= k.loss_divisor[0]:
                growth = k.loss_divisor_growth ** (step - k.loss_divisor[0])
                loss = loss / (k.loss_divisor[1] * growth)
            if scaler is not None:
                scaler.scale(loss).backward()
                if k.clip_scaled:
                    nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # still scaled: the bug
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if k.checkpoint_every and step % k.checkpoint_every == 0:
                path = checkpoint_dir / f"{scenario.name}-step{step}.pt"
                state = {"model": model.state_dict(), "step": step}
                if scaler is not None:
                    state["scaler"] = scaler.state_dict()
                handle.save_checkpoint(state, path, step=step)
        return handle.client_run_id


# --- what the collector stored ------------------------------------------------------------


@dataclass
class Observed:
    """A run as the collector's read API returns it."""

    run: dict[str, Any]
    steps: dict[str, Any]  # columnar /steps, exact (bucket_width 1)
    zero: dict[str, Any]  # /layers?stat=zero_fraction, exact
    flush: dict[str, Any]  # /layers?stat=flush_fraction, exact
    events: list[dict[str, Any]]
    checkpoints: list[dict[str, Any]]

    @property
    def run_id(self) -> str:
        return str(self.run["id"])

    def series(self, name: str) -> list[float]:
        return [_num(v) for v in self.steps[name]]

    def findings(self) -> set[str]:
        return {e["data"].get("code") for e in self.events if e["kind"] == "finding"}

    def layer_column(self, matrix: dict[str, Any], layer: str) -> list[float]:
        i = matrix["layers"].index(layer)
        return [_num(row[i]) for row in matrix["values"]]


def _num(value: Any) -> float:
    if value is None:
        return math.nan
    if isinstance(value, str):
        return float(value.replace("Infinity", "inf"))
    return float(value)


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or 'the collector'}")
        time.sleep(0.1)


def find_run(api: httpx.Client, client_run_id: str) -> dict[str, Any]:
    """The stored run of `client_run_id`, once the collector has seen it end."""
    found: dict[str, Any] = {}

    def ended() -> bool:
        runs = api.get("/api/v1/runs", params={"limit": 200}).json()["runs"]
        for run in runs:
            if run["client_run_id"] == client_run_id and run["status"] == "ended":
                found.update(run)
                return True
        return False

    wait_for(ended, what=f"run {client_run_id} to end")
    return found


def observe(api: httpx.Client, client_run_id: str, steps: int) -> Observed:
    run = find_run(api, client_run_id)
    rid = run["id"]
    series = api.get(f"/api/v1/runs/{rid}/steps", params={"max_points": 10 * steps}).json()
    assert series["bucket_width"] == 1, series["bucket_width"]
    layers = {
        stat: api.get(f"/api/v1/runs/{rid}/layers",
                      params={"stat": stat, "max_steps": 10 * steps}).json()
        for stat in ("zero_fraction", "flush_fraction")
    }  # fmt: skip
    for matrix in layers.values():
        assert matrix["step_width"] == 1 and matrix["layer_width"] == 1, matrix
    events = api.get(f"/api/v1/runs/{rid}/events").json()["events"]
    checkpoints = api.get(f"/api/v1/runs/{rid}/checkpoints").json()["checkpoints"]
    return Observed(
        run, series, layers["zero_fraction"], layers["flush_fraction"], events, checkpoints
    )


# --- ground truth -------------------------------------------------------------------------


def collapse_step(obs: Observed) -> int | None:
    for step, scale in zip(obs.steps["step"], obs.series("loss_scale")):
        if scale < 1.0:
            return int(step)
    return None


def precursor_step(obs: Observed) -> int | None:
    """Where the activation-norm rise began (see PRECURSOR_BEGIN), or None when the norm
    never stays above PRECURSOR_FACTOR x its rolling baseline for PRECURSOR_SUSTAIN steps."""
    act = obs.series("act_norm_mean")
    near, far = BASELINE_LAG

    def baseline(i: int) -> float | None:
        window = [a for a in act[max(i - far, 0) : max(i - near, 0)] if math.isfinite(a)]
        return statistics.median(window) if len(window) == far - near else None

    def above(i: int, factor: float, base: float) -> bool:
        return not math.isfinite(act[i]) or act[i] > factor * base

    for i in range(len(act) - PRECURSOR_SUSTAIN + 1):
        base = baseline(i)
        if base is None or not all(
            above(j, PRECURSOR_FACTOR, base) for j in range(i, i + PRECURSOR_SUSTAIN)
        ):
            continue
        began = i
        while began > 0 and above(began - 1, PRECURSOR_BEGIN, base):
            began -= 1
        return int(obs.steps["step"][began])
    return None


def frozen_layers(obs: Observed) -> dict[str, int]:
    """Layers whose gradient was exactly all-zero at a sampled step that was not skipped
    (a skipped step's gradients are Inf/NaN or discarded, which explains zeros), each with
    the first such step."""
    skipped = dict(zip(obs.steps["step"], obs.steps["skipped"]))
    out: dict[str, int] = {}
    for layer in obs.zero["layers"]:
        column = obs.layer_column(obs.zero, layer)
        for step, value in zip(obs.zero["steps"], column):
            if value >= 1.0 and not skipped.get(step):
                out[layer] = int(step)
                break
    return out


def scale_at(obs: Observed, step: int) -> float:
    return obs.series("loss_scale")[obs.steps["step"].index(step)]


def healthy_checkpoint(obs: Observed, onset: int | None) -> int | None:
    """The last checkpoint at least LABEL_MARGIN steps before `onset` with the scale still
    >= 1.0 and no skipped step in the 10 steps up to it (not mid-fall)."""
    if onset is None:
        return None
    skipped = dict(zip(obs.steps["step"], obs.steps["skipped"]))
    best = None
    for ckpt in obs.checkpoints:
        step = int(ckpt["step"])
        if step > onset - LABEL_MARGIN or scale_at(obs, step) < 1.0:
            continue
        if any(skipped.get(s) for s in range(step - 9, step + 1)):
            continue
        best = step if best is None else max(best, step)
    return best


def ground_truth(scenario: Scenario, obs: Observed) -> Label:
    """The scenario's label with its ground-truth steps measured from `obs`."""
    precursor = precursor_step(obs)
    frozen = frozen_layers(obs)
    label = replace(
        scenario.label,
        collapse_step=collapse_step(obs),
        precursor_step=precursor,
        first_frozen_step=min(frozen.values()) if frozen else None,
    )
    if scenario.label.check_advisor:
        label = replace(label, healthy_checkpoint=healthy_checkpoint(obs, precursor))
    return label


# --- signal checks: did the training do what the scenario says? -------------------------


def _skips(obs: Observed, lo: int = 1, hi: int | None = None) -> int:
    return sum(
        1 for s, k in zip(obs.steps["step"], obs.steps["skipped"])
        if k and s >= lo and (hi is None or s <= hi)
    )  # fmt: skip


def check_healthy_fp16(obs: Observed, label: Label, *, learns: float = 0.8) -> list[str]:
    problems = []
    if _skips(obs, 1, 30) < 3:
        problems.append(f"no warm-up calibration cascade: {_skips(obs, 1, 30)} skips in steps 1-30")
    if _skips(obs, 31) > 3:
        problems.append(f"{_skips(obs, 31)} skips after warm-up")
    if label.collapse_step is not None:
        problems.append(f"scale fell below 1.0 at step {label.collapse_step}")
    if frozen := sorted(frozen_layers(obs)):
        problems.append(f"layers froze: {frozen}")
    losses = [v for v in obs.series("loss") if math.isfinite(v)]
    if not losses[-1] < losses[0] * learns:
        problems.append(f"loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}")
    return problems


def check_healthy_bf16(obs: Observed, label: Label) -> list[str]:
    problems = []
    if "bf16_in_use" not in obs.findings():
        problems.append("no bf16_in_use finding")
    if _skips(obs) or any(math.isfinite(v) for v in obs.series("loss_scale")):
        problems.append("a BF16 run without a scaler reported skips or a loss scale")
    if frozen := sorted(frozen_layers(obs)):
        problems.append(f"layers froze: {frozen}")
    losses = obs.series("loss")
    if not all(math.isfinite(v) for v in losses) or not losses[-1] < losses[0] * 0.8:
        problems.append(f"loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}")
    return problems


def check_big_embedding(obs: Observed, label: Label) -> list[str]:
    problems = check_healthy_fp16(obs, label, learns=0.98)  # rare rows learn slowly
    emb = [v for v in obs.layer_column(obs.zero, "emb.weight") if math.isfinite(v)]
    if not emb or min(emb) < 0.95 or max(emb) >= 1.0:
        problems.append(f"emb.weight zero fraction not structural (0.95..1): {emb[:5]}...")
    return problems


def check_underflow(obs: Observed, label: Label, *, onset: int | None) -> list[str]:
    problems = []
    frozen = frozen_layers(obs)
    if len(frozen) < 2:
        problems.append(f"fewer than two layers froze: {frozen}")
    first = label.first_frozen_step
    if onset is not None and first is not None and first < onset:
        problems.append(f"a layer froze at {first}, before the onset {onset}")
    if _skips(obs):
        problems.append(f"{_skips(obs)} skipped steps: underflow must be silent")
    if not all(math.isfinite(v) for v in obs.series("loss")):
        problems.append("a non-finite loss: underflow must be silent")
    return problems


def check_fp16_no_scaler(obs: Observed, label: Label) -> list[str]:
    problems = check_underflow(obs, label, onset=UNDERFLOW_ONSET)
    if "fp16_params_without_scaler" not in obs.findings():
        problems.append("no fp16_params_without_scaler finding")
    return problems


def check_fp16_drift(obs: Observed, label: Label) -> list[str]:
    problems = check_fp16_no_scaler_at(obs, label, DRIFT_ONSET)
    first = label.first_frozen_step
    if first is not None and first < DRIFT_ONSET + 20:
        problems.append(f"a layer froze at {first}: too soon for a drift")
    return problems


def check_fp16_no_scaler_at(obs: Observed, label: Label, onset: int) -> list[str]:
    problems = check_underflow(obs, label, onset=onset)
    if "fp16_params_without_scaler" not in obs.findings():
        problems.append("no fp16_params_without_scaler finding")
    return problems


def check_static_scale(obs: Observed, label: Label) -> list[str]:
    problems = check_underflow(obs, label, onset=None)
    scales = set(obs.series("loss_scale"))
    if len(scales) != 1 or min(scales) < 1.0:
        problems.append(f"the scale was not a static value >= 1.0: {sorted(scales)[:5]}")
    flush = [v for row in obs.flush["values"][2:] for v in row if v is not None]
    if not flush or max(flush) < 0.5:
        problems.append(f"no layer forecast to flush >= 50% (max {max(flush, default=0):.3f})")
    return problems


def check_divergence(obs: Observed, label: Label) -> list[str]:
    problems = []
    if label.collapse_step is None:
        problems.append("the scale never fell below 1.0")
    if label.precursor_step is None:
        problems.append("no activation-norm precursor")
    elif label.collapse_step is not None:
        first_storm = _first_steady_skip(obs)
        if first_storm is None or not label.precursor_step < first_storm < label.collapse_step:
            problems.append(
                f"precursor {label.precursor_step} / first steady-state skip {first_storm} / "
                f"collapse {label.collapse_step} out of order"
            )
    if label.precursor_step is not None and label.precursor_step <= BLOWUP_FROM:
        problems.append(
            f"precursor at {label.precursor_step}, before its cause (the lr ramp "
            f"from step {BLOWUP_FROM})"
        )
    before_cause = [c["step"] for c in obs.checkpoints if c["step"] <= BLOWUP_FROM]
    if label.healthy_checkpoint != max(before_cause, default=None):
        problems.append(
            f"the data-derived healthy checkpoint {label.healthy_checkpoint} is not "
            f"the last one before the lr ramp ({max(before_cause, default=None)})"
        )
    if label.healthy_checkpoint is None:
        problems.append("no checkpoint qualifies as the healthy restart point")
    elif not any(c["step"] > label.healthy_checkpoint and scale_at(obs, c["step"]) >= 1.0
                 for c in obs.checkpoints):  # fmt: skip
        problems.append(
            "no later checkpoint with a scale >= 1.0: picking the labeled one "
            "would not test the precursor margin"
        )
    return problems


def _first_steady_skip(obs: Observed) -> int | None:
    """The first skipped step after the warm-up cascade (steps 1-30)."""
    for step, skipped in zip(obs.steps["step"], obs.steps["skipped"]):
        if skipped and step > 30:
            return int(step)
    return None


def check_transient(obs: Observed, label: Label) -> list[str]:
    problems = [
        f"the injected overflow at step {step} was not skipped"
        for step in TRANSIENT_STEPS
        if not obs.steps["skipped"][step - 1]
    ]
    steady = _skips(obs, 31)
    if steady > len(TRANSIENT_STEPS) + 2:
        problems.append(f"{steady} skips after warm-up; expected ~{len(TRANSIENT_STEPS)}")
    if label.collapse_step is not None:
        problems.append(f"scale fell below 1.0 at step {label.collapse_step}")
    return problems


def check_clip(obs: Observed, label: Label) -> list[str]:
    problems = []
    if "clip_before_unscale" not in obs.findings():
        problems.append("no clip_before_unscale finding")
    if label.collapse_step is not None:
        problems.append(f"scale fell below 1.0 at step {label.collapse_step}")
    return problems


def check_nan(obs: Observed, label: Label) -> list[str]:
    problems = []
    losses = obs.series("loss")
    nan_at = {i + 1 for i, v in enumerate(losses) if math.isnan(v)}
    if nan_at != set(NAN_STEPS):
        problems.append(f"NaN losses at {sorted(nan_at)}, injected at {sorted(NAN_STEPS)}")
    problems.extend(
        f"the NaN step {step} was not skipped"
        for step in NAN_STEPS
        if not obs.steps["skipped"][step - 1]
    )
    if label.collapse_step is not None:
        problems.append(f"scale fell below 1.0 at step {label.collapse_step}")
    return problems


# --- the catalog --------------------------------------------------------------------------

#: Steps of a real 16x16-token batch; the per-token loss is normalised by a global token
#: count of 2^16 (a large data-parallel batch), which puts FP16 gradients below 2^-24.
UNDERFLOW_DIVISOR = 2.0**16
UNDERFLOW_ONSET = 81  # the loss normalisation changes here (e.g. accumulation grew)
DRIFT_ONSET, DRIFT_GROWTH = 40, 1.2  # a normaliser growing x1.2 per step from step 40
#: The learning rate starts climbing (x1.2 per step) after this step: the cause, known to
#: the scenario, against which the data-derived label is cross-checked.
BLOWUP_FROM = 122
TRANSIENT_STEPS = (150,)
NAN_STEPS = (150,)

#: A healthy run pages for nothing: every rule is a false alert there.
EVERYTHING = frozenset(RULES)

SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "healthy_fp16",
        "FP16 autocast with a GradScaler from 2^32: a warm-up calibration cascade, then calm",
        Knobs(checkpoint_every=60),
        Label(must_not_fire=EVERYTHING, must_not_fire_severity=frozenset({"warning", "critical"})),
        check_healthy_fp16,
    ),
    Scenario(
        "healthy_bf16",
        "BF16 autocast, no scaler (none needed: FP32's exponent range)",
        Knobs(dtype=torch.bfloat16, scaler=None),
        Label(must_not_fire=EVERYTHING),
        check_healthy_bf16,
    ),
    Scenario(
        "big_embedding",
        f"FP16 + scaler, a {BIG_VOCAB}-row embedding: ~98% of its gradient rows are zero "
        "every step (structural zeros, not underflow)",
        Knobs(vocab_in=BIG_VOCAB),
        Label(must_not_fire=EVERYTHING),
        check_big_embedding,
    ),
    Scenario(
        "fp16_no_scaler_underflow",
        f"FP16 autocast, no scaler; from step {UNDERFLOW_ONSET} the loss is divided by a "
        "global token count of 2^16: block gradients flush to exactly zero, loss looks normal",
        Knobs(scaler=None, loss_divisor=(UNDERFLOW_ONSET, UNDERFLOW_DIVISOR)),
        Label(
            must_fire=frozenset({"fp16_without_scaler", "silent_underflow"}),
            must_not_fire=frozenset(
                {
                    "loss_scale_collapse",
                    "nan_loss",
                    "scale_floor_stall",
                    "skip_rate",
                    "clip_before_unscale",
                    "no_data",
                }
            ),
            # The loss the agent reports is the divided one: 2^16 lower in one step, not a
            # run converging there, so loss_collapse warns at the incident's second step.
            may_fire=frozenset({"underflow_risk", "loss_collapse"}),
        ),
        check_fp16_no_scaler,
    ),
    Scenario(
        "fp16_drifting_underflow",
        f"FP16 autocast, no scaler; from step {DRIFT_ONSET} the loss normaliser grows "
        f"x{DRIFT_GROWTH} per step: gradients drift into FP16's subnormal range, then flush; "
        "the forecast must page before the first layer freezes",
        Knobs(scaler=None, loss_divisor=(DRIFT_ONSET, 1.0), loss_divisor_growth=DRIFT_GROWTH),
        Label(
            must_fire=frozenset({"fp16_without_scaler", "underflow_risk", "silent_underflow"}),
            must_not_fire=frozenset(
                {
                    "loss_scale_collapse",
                    "nan_loss",
                    "scale_floor_stall",
                    "skip_rate",
                    "clip_before_unscale",
                    "no_data",
                }
            ),
            may_fire=frozenset({"grad_norm_spike", "loss_spike"}),
            forecast_before_freeze=True,
        ),
        check_fp16_drift,
    ),
    Scenario(
        "static_scale_too_small",
        "FP16 + a GradScaler pinned at 4.0 (growth_interval 10^9) while the loss is divided "
        "by a global token count of 2^16: the scale is far too small, grads flush to zero",
        Knobs(scaler={"init_scale": 4.0, "growth_interval": 10**9}, loss_divisor=(1, 2.0**16)),
        Label(
            must_fire=frozenset({"underflow_risk", "silent_underflow"}),
            must_not_fire=frozenset(
                {
                    "loss_scale_collapse",
                    "nan_loss",
                    "scale_floor_stall",
                    "skip_rate",
                    "fp16_without_scaler",
                    "clip_before_unscale",
                    "no_data",
                }
            ),
        ),
        check_static_scale,
    ),
    Scenario(
        "lr_blowup_collapse",
        "FP16 + scaler, lr x1.08 per step: the final-layer activation norm rises, then every "
        "step overflows and the scale halves toward zero (OPT-175B); checkpoints every 20",
        Knobs(
            steps=200,
            scaler={"init_scale": 2.0**16, "growth_interval": 50},
            lr_growth=1.2,
            lr_growth_from=BLOWUP_FROM,
            checkpoint_every=20,
        ),
        Label(
            must_fire=frozenset({"activation_norm_spike", "loss_scale_collapse"}),
            must_not_fire=frozenset(
                {
                    "fp16_without_scaler",
                    "clip_before_unscale",
                    "no_data",
                    "silent_underflow",
                    "underflow_risk",
                }
            ),
            # The overflow storm and the loss / grad-norm spikes are this incident's too, and
            # the early warnings before it (Adam's update RMS rises 1 step before the
            # ground-truth precursor).
            may_fire=frozenset(
                {
                    "skip_rate",
                    "nan_loss",
                    "overflow_burst",
                    "loss_spike",
                    "grad_norm_spike",
                    "update_rms_rise",
                    "scale_decline",
                }
            ),
            collapse_before_floor=True,
            check_advisor=True,
        ),
        check_divergence,
    ),
    Scenario(
        "transient_overflow",
        f"healthy FP16 + scaler; the loss is multiplied by 1e30 once (step "
        f"{TRANSIENT_STEPS[0]}): one skipped step, one halving",
        Knobs(overflow_steps=frozenset(TRANSIENT_STEPS)),
        Label(
            must_not_fire=frozenset(
                {
                    "loss_scale_collapse",
                    "nan_loss",
                    "scale_floor_stall",
                    "silent_underflow",
                    "fp16_without_scaler",
                    "clip_before_unscale",
                    "no_data",
                }
            )
        ),
        check_transient,
    ),
    Scenario(
        "clip_before_unscale",
        "FP16 + scaler, clip_grad_norm_ on the still-scaled gradients every step",
        Knobs(clip_scaled=True),
        Label(
            must_fire=frozenset({"clip_before_unscale"}),
            must_not_fire=frozenset(
                {
                    "loss_scale_collapse",
                    "nan_loss",
                    "scale_floor_stall",
                    "fp16_without_scaler",
                    "no_data",
                }
            ),
        ),
        check_clip,
    ),
    Scenario(
        "nan_loss",
        f"FP16 + scaler; one corrupted input (a NaN embedding value) at step {NAN_STEPS[0]}",
        Knobs(nan_steps=frozenset(NAN_STEPS)),
        Label(
            must_fire=frozenset({"nan_loss"}),
            must_not_fire=frozenset(
                {
                    "loss_scale_collapse",
                    "scale_floor_stall",
                    "silent_underflow",
                    "fp16_without_scaler",
                    "clip_before_unscale",
                    "no_data",
                }
            ),
            may_fire=frozenset({"skip_rate"}),
        ),
        check_nan,
    ),
)

BY_NAME = {s.name: s for s in SCENARIOS}
