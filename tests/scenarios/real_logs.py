"""The real-log corpus (`tests/data/real_logs/`): excerpts of public training logs, parsed
into step series, and the peers' published detectors computed on the same series.

Shared by `test_real_logs.py` and `bench/detection.py` (imported by file name). Each
excerpt keeps its provenance in its `#` header; `labels.json` says only what the source
says happened (an incident with the latest step a monitor may fire, a healthy run, or a
transient that the source says recovered) and marks every inference as one.

The parsers are deliberately small (a separate issue builds the user-facing
`ampwatch import`); what each one infers is said in its docstring:

- ``megatron``: Megatron-LM / Megatron-DeepSpeed ``iteration N/ M | ... lm loss: ... |
  loss scale: ... | grad norm: ...`` lines, and DeepSpeed's ``OVERFLOW! ... Attempted loss
  scale: A, reducing to B`` lines printed during the next iteration (Megatron-DeepSpeed logs
  "number of skipped iterations: 0" while DeepSpeed owns the scaler and skips).
- ``deepspeed``: bare DeepSpeed OVERFLOW lines, one skipped step each, numbered from 1.
- ``deepspeed-tqdm``: the HF Trainer's progress counter (``N/TOTAL [``) with DeepSpeed's
  OVERFLOW lines and the Trainer's ``{'loss': ...}`` logs.
- ``fairseq``: ``num_updates`` lines (train / train_inner / epoch summaries) and
  ``overflow detected, setting loss scale to: X`` lines; checkpoints from ``saved
  checkpoint ... (epoch E @ N updates``.
- ``deepspeed-engine``: a DeepSpeed engine's own log, trimmed to its ``step=N, skipped=K``
  lines, its overflow lines and (FP16_Optimizer) ``Grad overflow on iteration N`` /
  ``Increasing dynamic loss scale`` lines: every attempt 1..N is a step, at the scale
  DeepSpeed's dynamic scaler had (the ``# scaler:`` header says its settings).
- ``apex``: ``Gradient overflow. Skipping step, loss scaler 0 reducing loss scale to X``.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).resolve().parents[1] / "data" / "real_logs"


@dataclass
class Step:
    """One optimizer step (or attempt) as a log shows it; None = the log does not say."""

    step: int
    loss: float | None = None
    loss_scale: float | None = None
    skipped: bool = False
    grad_norm: float | None = None


@dataclass
class Excerpt:
    name: str
    format: str
    source: str
    steps: list[Step]
    checkpoints: list[tuple[int, str]] = field(default_factory=list)
    #: The scaler's configured floor (the ``# min_loss_scale:`` header, its source and
    #: whether it is an inference in ``# min_loss_scale-source:``); None: not known.
    min_loss_scale: float | None = None


@dataclass(frozen=True)
class Label:
    """What the source says happened. `kind`: incident (a monitor must alert by
    `deadline_step`), healthy (nothing may page: no critical, warnings counted), transient
    (the source says the run recovered by itself: warnings allowed, no critical), or
    unlabeled (replayed and shown, judged by nothing)."""

    kind: str
    deadline_step: int | None
    says: str
    inference: str
    #: The first step the source shows as part of the incident: a peer's flag raised
    #: before it (and held since) was already flagging the healthy part, not the incident.
    onset_step: int | None = None


_NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf)"
_OVERFLOW = re.compile(
    r"OVERFLOW! Rank 0 Skipping step\. Attempted loss scale: "
    + _NUMBER
    + r"(?:, reducing to "
    + _NUMBER
    + r"|, but hysteresis)"
)


def _field(line: str, name: str, sep: str = ":") -> float | None:
    match = re.search(re.escape(name) + r"\s*" + re.escape(sep) + r"\s*" + _NUMBER, line)
    return float(match.group(1)) if match else None


def _megatron(lines: list[str]) -> list[Step]:
    """Iteration lines; an OVERFLOW line marks the next iteration skipped, at the scale it
    attempted. Inferences: on a skipped iteration the logged grad norm repeats the last
    applied one (it is dropped); "grad norm: 0.000" (older Megatron-DeepSpeed without the
    norm) is not measured; a missing "lm loss" (Megatron prints only a positive average,
    so NaN or no applied iteration) is not measured; "number of skipped iterations: N" > 0
    on a line covering a log interval marks that line's step skipped; a scale logged lower
    than the previous (consecutive) iteration's marks a skip at the previous scale."""
    steps: list[Step] = []
    attempted: float | None = None
    previous: float | None = None  # the last line's logged scale (after its update)
    for line in lines:
        if (match := _OVERFLOW.search(line)) is not None:
            attempted = float(match.group(1))
            continue
        it = re.search(r"iteration\s+(\d+)/", line)
        if it is None or "lm loss value" in line:
            continue
        skips = _field(line, "number of skipped iterations") or 0.0
        norm = _field(line, "grad norm")
        step = Step(int(it.group(1)), loss=_field(line, "lm loss"),
                    loss_scale=_field(line, "loss scale"), skipped=skips > 0,
                    grad_norm=norm if norm else None)  # fmt: skip
        logged = step.loss_scale
        if attempted is not None:
            step.skipped, step.loss_scale, step.grad_norm = True, attempted, None
            attempted = None
        elif (
            steps
            and steps[-1].step == step.step - 1
            and logged is not None
            and previous is not None
            and logged < previous
        ):
            # A scale logged lower than the previous iteration's: DeepSpeed halved it on
            # an overflow of this iteration (inference; its OVERFLOW line is not excerpted).
            step.skipped, step.loss_scale, step.grad_norm = True, previous, None
        previous = logged
        steps.append(step)
    return steps


def _deepspeed(lines: list[str]) -> list[Step]:
    """Inference: each OVERFLOW line is one skipped step, and the lines are consecutive
    steps from 1 (the excerpts are a run's first lines; no step numbers are logged)."""
    out = []
    for line in lines:
        if (match := _OVERFLOW.search(line)) is not None:
            out.append(Step(len(out) + 1, loss_scale=float(match.group(1)), skipped=True))
    return out


def _deepspeed_tqdm(lines: list[str]) -> list[Step]:
    """The progress counter N is printed after step N: an OVERFLOW line printed after
    counter N (or before the first counter) belongs to step N + 1 (or to that counter).
    A step's loss scale is the one it attempted, else the last one DeepSpeed reduced to;
    before the first OVERFLOW line the log does not say (None). The Trainer's
    ``{'loss': x}`` (an average since its last log) goes to the last counted step."""
    by_step: dict[int, Step] = {}
    last: int | None = None
    scale: float | None = None
    pending: float | None = None  # attempted scale of an OVERFLOW before the first counter
    for line in lines:
        if line.startswith("#"):
            continue
        for token in re.finditer(r"(\d+)/\d+ \[|" + _OVERFLOW.pattern + r"|\{'loss': " + _NUMBER,
                                 line):  # fmt: skip
            text = token.group(0)
            if text.endswith("["):
                n = int(token.group(1))
                if n not in by_step:
                    by_step[n] = Step(n, loss_scale=scale)
                if pending is not None:
                    by_step[n].skipped, by_step[n].loss_scale = True, pending
                    pending = None
                last = n
            elif text.startswith("{'loss'"):
                if last is not None:
                    by_step[last].loss = float(token.group(token.lastindex or 0))
            else:
                match = _OVERFLOW.search(text)
                assert match is not None
                attempted = float(match.group(1))
                reduced = match.group(2)
                scale = float(reduced) if reduced is not None else attempted
                if last is None:
                    pending = attempted
                else:
                    by_step[last + 1] = Step(last + 1, loss_scale=attempted, skipped=True)
    if pending is not None:
        by_step[1] = Step(1, loss_scale=pending, skipped=True)
    return [by_step[n] for n in sorted(by_step)]


def _fairseq(lines: list[str], checkpoints: list[tuple[int, str]]) -> list[Step]:
    """fairseq does not count an overflowed update in num_updates, so a step here is an
    attempt: num_updates plus the overflows logged so far (inference: each overflow line is
    the attempt after the last one logged). An overflow line before any numbered line has
    no place and is dropped. loss_scale is printed to 3 decimals: a printed 0 is a value
    rounded away (not measured); otherwise the exact value of the last overflow line is
    used where it rounds to the printed one. An overflow attempt ran at twice the scale it
    set (fairseq's scale factor 2)."""
    steps: list[Step] = []
    skips = 0
    exact: float | None = None
    for line in lines:
        match = re.search(r"overflow detected, setting loss scale to: " + _NUMBER, line)
        if match is not None:
            new = float(match.group(1))
            exact = new
            if steps:
                skips += 1
                steps.append(Step(steps[-1].step + 1, loss_scale=2 * new, skipped=True))
            continue
        saved = re.search(r"saved checkpoint (\S+) \(epoch \d+ @ (\d+) updates", line)
        if saved is not None:
            checkpoints.append((int(saved.group(2)) + skips, saved.group(1)))
            continue
        if "valid on" in line:
            continue
        if (js := re.search(r"\{.*\}", line)) is not None and '"train_num_updates"' in line:
            # fairseq's JSON log format: {"train_loss": "816.933", "train_num_updates": ...}
            values = json.loads(js.group(0))
            line = " | ".join(f"{k.removeprefix('train_')} {v}" for k, v in values.items())
        updates = _field(line, "num_updates", "=") or _field(line, "num_updates", "")
        if updates is None:
            continue
        printed = _field(line, "loss_scale", "=")
        if printed is None:
            printed = _field(line, "loss_scale", "")
        scale: float | None = printed
        if printed is not None and exact is not None and abs(round(exact, 3) - printed) < 1e-9:
            scale = exact
        if printed == 0:
            scale = None
        loss = _field(line, "loss", "=")
        if loss is None:
            loss = _field(line, "| loss", "")
        if loss is None and line.startswith("epoch "):
            loss = _field(line, "loss", "")
        norm = _field(line, "gnorm", "=") or _field(line, "gnorm", "")
        step = int(updates) + skips
        if steps and step <= steps[-1].step:
            continue  # an epoch summary repeating the last train_inner step
        steps.append(Step(step, loss=loss, loss_scale=scale, grad_norm=norm))
    return steps


_STAMP = r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]"


def _seconds(match: re.Match[str]) -> float:
    from datetime import datetime

    when = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")
    return when.timestamp() + int(match.group(2)) / 1000


def _deepspeed_engine(lines: list[str], scaler: dict[str, float]) -> list[Step]:
    """Every attempt from 1 to the last ``step=N`` line (DeepSpeed's global step counts
    skipped attempts too; ``skipped=K`` counts them). A skipped attempt is exact where
    FP16_Optimizer logs ``Grad overflow on iteration i`` (attempt i + 1); otherwise
    (inference) each overflow line is placed by its time stamp between the two ``step=``
    lines around it, at the interval's mean time per attempt. The scale between overflows
    is DeepSpeed's DynamicLossScaler replayed with the ``# scaler:`` settings (halve on an
    overflow once hysteresis is spent, double after ``scale_window`` clean attempts); the
    test checks that the replay attempts every overflow at the scale the log prints."""
    marks: list[tuple[int, float]] = []  # (attempt, time) of each step=N line
    overflow_times: list[float] = []
    exact: set[int] = set()
    for line in lines:
        stamp = re.match(_STAMP, line)
        if (m := re.search(r"step=(\d+), skipped=(\d+)", line)) and stamp:
            marks.append((int(m.group(1)), _seconds(stamp)))
        elif (m := re.match(r"Grad overflow on iteration (\d+)", line)) is not None:
            exact.add(int(m.group(1)) + 1)
        elif "Skipping step" in line and stamp:
            overflow_times.append(_seconds(stamp))
    skipped = set(exact)
    if not exact:
        for t in overflow_times:
            after = next((i for i, (_, tm) in enumerate(marks) if tm >= t), len(marks) - 1)
            hi_step, hi_t = marks[after]
            lo_step, lo_t = marks[after - 1] if after > 0 else (0, None)
            per = (hi_t - lo_t) / (hi_step - lo_step) if lo_t is not None else None
            if per is None and after + 1 < len(marks):
                per = (marks[after + 1][1] - hi_t) / (marks[after + 1][0] - hi_step)
            guess = hi_step - round((hi_t - t) / per) if per else hi_step
            guess = min(max(guess, lo_step + 1), hi_step)
            while guess in skipped and guess < hi_step:
                guess += 1
            while guess in skipped:
                guess -= 1
            skipped.add(guess)
    scale, window = scaler["init_scale"], int(scaler["scale_window"])
    shift = int(scaler.get("delayed_shift", 1))
    hysteresis, last_overflow = shift, 0
    steps = []
    for attempt in range(1, marks[-1][0] + 1 if marks else 1):
        steps.append(Step(attempt, loss_scale=scale, skipped=attempt in skipped))
        if attempt in skipped:
            if shift == 1 or hysteresis == 1:
                scale = max(scale / 2, scaler.get("min_scale", 1.0))
            else:
                hysteresis -= 1
            last_overflow = attempt
        elif (attempt - last_overflow) % window == 0:
            hysteresis = shift
            scale *= 2
    return steps


def _apex(lines: list[str]) -> list[Step]:
    """Inference: consecutive steps from 1 (apex logs no step), each attempted at twice
    the scale it reduced to (apex's backoff factor 2)."""
    out = []
    for line in lines:
        match = re.search(r"reducing loss scale to " + _NUMBER, line)
        if match is not None:
            out.append(Step(len(out) + 1, loss_scale=2 * float(match.group(1)), skipped=True))
    return out


def load_excerpt(path: Path) -> Excerpt:
    text = path.read_text(encoding="utf-8").splitlines()
    header = {m.group(1): m.group(2) for line in text
              if (m := re.match(r"# (\w+): (.*)", line))}  # fmt: skip
    fmt = header["format"]
    lines = [line for line in text if not line.startswith("# ")]
    checkpoints: list[tuple[int, str]] = []
    parse: dict[str, Callable[[list[str]], list[Step]]] = {
        "megatron": _megatron,
        "deepspeed": _deepspeed,
        "deepspeed-tqdm": _deepspeed_tqdm,
        "apex": _apex,
        "fairseq": lambda ls: _fairseq(ls, checkpoints),
        "deepspeed-engine": lambda ls: _deepspeed_engine(ls, _settings(header["scaler"])),
    }
    steps = parse[fmt](lines)
    floor = header.get("min_loss_scale")
    return Excerpt(path.stem, fmt, header["source"], steps, checkpoints,
                   float(floor) if floor is not None else None)  # fmt: skip


def _settings(text: str) -> dict[str, float]:
    """``init_scale=65536 scale_window=100`` -> {"init_scale": 65536.0, ...}."""
    return {k: float(v) for k, v in (item.split("=") for item in text.split())}


def logged_attempts(path: Path) -> list[float]:
    """The scales a DeepSpeed log says its overflowed attempts ran at, in order (to check
    the parser's replay of the scaler against)."""
    pattern = re.compile(r"Attempted loss scale: " + _NUMBER)
    return [float(m.group(1)) for line in path.read_text(encoding="utf-8").splitlines()
            if (m := pattern.search(line))]  # fmt: skip


def labels() -> dict[str, Label]:
    data = json.loads((CORPUS / "labels.json").read_text(encoding="utf-8"))
    return {name: Label(kind=entry["kind"], deadline_step=entry.get("deadline_step"),
                        says=entry["says"], inference=entry.get("inference", ""),
                        onset_step=entry.get("onset_step"))
            for name, entry in data["runs"].items()}  # fmt: skip


def corpus() -> list[tuple[Excerpt, Label]]:
    """Every labeled excerpt, in name order."""
    labeled = labels()
    return [(load_excerpt(CORPUS / f"{name}.log"), labeled[name]) for name in sorted(labeled)]


# -- replay through the agent's manual API --------------------------------------------------


def replay(
    excerpt: Excerpt, url: str, *, project: str = "real-logs", report_floor: bool = True
) -> str:
    """Send `excerpt` through `handle.record()` into the collector at `url`, as a loop with
    DeepSpeed / fairseq / Megatron / apex would, reporting the scaler's floor where the
    excerpt knows it (`report_floor`); return the run's client id."""
    import torch

    from ampwatch.agent import watch

    by_step = dict(excerpt.checkpoints)
    floor = excerpt.min_loss_scale if report_floor else None
    with watch(torch.nn.Linear(1, 1), run=excerpt.name, project=project, url=url,
               min_loss_scale=floor, flush_interval=0.2) as handle:  # fmt: skip
        for s in excerpt.steps:
            handle.record(step=s.step, loss=s.loss, loss_scale=s.loss_scale, skipped=s.skipped,
                          grad_norm=s.grad_norm)  # fmt: skip
            if s.step in by_step:
                handle.checkpoint(by_step[s.step], step=s.step)
        for step, path in excerpt.checkpoints:
            if step not in {s.step for s in excerpt.steps}:
                handle.checkpoint(path, step=step)
        return handle.client_run_id


# -- the peers' published rules, on the same series ------------------------------------------


def _losses(steps: Iterable[Step]) -> list[tuple[int, float]]:
    return [(s.step, s.loss) for s in steps if s.loss is not None and math.isfinite(s.loss)]


def megatron_spiky_loss(steps: list[Step], factor: float = 10.0, first: int = 100) -> list[int]:
    """Megatron-LM's rerun state machine: a loss >= `factor` x the max |loss| of the first
    `first` values (judged once those exist)."""
    values = _losses(steps)
    if len(values) <= first:
        return []
    ceiling = factor * max(abs(v) for _, v in values[:first])
    return [s for s, v in values[first:] if v >= ceiling]


def olmo_core_spike(steps: list[Step], window: int = 128, sigmas: float = 6.0,
                    attr: str = "loss") -> list[int]:  # fmt: skip
    """OLMo-core StabilityMonitor: value > mean + 6 sigma of the last 128 values (a full
    window)."""
    values = [(s.step, getattr(s, attr)) for s in steps]
    values = [(st, v) for st, v in values if v is not None and math.isfinite(v)]
    out = []
    for i in range(window, len(values)):
        recent = [v for _, v in values[i - window : i]]
        if values[i][1] > statistics.fmean(recent) + sigmas * statistics.pstdev(recent):
            out.append(values[i][0])
    return out


def lightning_spike(steps: list[Step], window: int = 10, rtol: float = 2.0,
                    warmup: int = 1) -> list[int]:  # fmt: skip
    """Lightning Fabric SpikeDetection defaults (mode min, window 10, warmup 1, rtol 2.0,
    atol None): a spike when the loss is not an improvement over the running mean of the
    last `window` values and |loss - mean| >= rtol * mean, once `warmup` values are in."""
    values = _losses(steps)
    out = []
    for i in range(len(values)):
        recent = [v for _, v in values[max(0, i - window) : i]]
        if len(recent) < max(warmup, 1):
            continue
        mean = statistics.fmean(recent)
        value = values[i][1]
        if value > mean and abs(value - mean) >= rtol * abs(mean):
            out.append(values[i][0])
    return out


def fixed_min_scale(steps: list[Step], min_scale: float = 1.0) -> list[int]:
    """A fixed floor on the loss scale (DeepSpeed / Megatron 1; fairseq 1e-4)."""
    return [s.step for s in steps if s.loss_scale is not None and s.loss_scale < min_scale]


PEERS: dict[str, Callable[[list[Step]], list[int]]] = {
    "megatron_10x_first100": megatron_spiky_loss,
    "olmo_6sigma_128": olmo_core_spike,
    "lightning_spike": lightning_spike,
    "min_scale_1 (DeepSpeed)": fixed_min_scale,
    "min_scale_1e-4 (fairseq)": lambda steps: fixed_min_scale(steps, 1e-4),
}


#: Known, measured exceptions to "no later than any peer": (excerpt, peer) -> the steps by
#: which ampwatch is later, and why. None since runs report their scaler's floor: with
#: fairseq's 1e-4 reported, fairseq-1895's first skip (0.001, 2^3.3 above it) fires at once.
#: Without it (`replay(report_floor=False)`) ampwatch waits for a second skip below 1.0
#: (trend_skips) and is 1 step later than a fixed min_scale of 1, the price of keeping
#: healthy fairseq-2493 (one skip at 0.5 per epoch) quiet.
KNOWN_LATER: dict[tuple[str, str], int] = {}


def first_alert(steps: list[int]) -> int | None:
    return min(steps) if steps else None


def peer_alerts(excerpt: Excerpt) -> dict[str, int | None]:
    return {name: first_alert(rule(excerpt.steps)) for name, rule in PEERS.items()}


def to_json(excerpt: Excerpt) -> dict[str, Any]:  # for debugging a parser
    return {"name": excerpt.name, "steps": [s.__dict__ for s in excerpt.steps],
            "checkpoints": excerpt.checkpoints}  # fmt: skip


# -- judging a replay ----------------------------------------------------------------------


@dataclass
class Verdict:
    """One excerpt's replay: ampwatch's fired alerts and the peers' first flags, judged
    against its label."""

    excerpt: Excerpt
    label: Label
    alerts: list[dict[str, Any]]  # fired (firing or since resolved)
    advisor: dict[str, Any] | None
    peers: dict[str, list[int]]

    @property
    def first_alert(self) -> int | None:
        steps = [int(a["fired_step"]) for a in self.alerts if a.get("fired_step") is not None]
        return min(steps) if steps else None

    @property
    def lead(self) -> int | None:
        """Steps from ampwatch's first alert to the deadline (negative: late)."""
        if self.first_alert is None or self.label.deadline_step is None:
            return None
        return self.label.deadline_step - self.first_alert

    def caught(self) -> bool:
        return self.lead is not None and self.lead >= 0

    def peer_caught(self, peer: str) -> int | None:
        """The step at which the peer's flag for the incident came up (at or before the
        deadline), else None. A flag held since before the onset is not a detection."""
        deadline, onset = self.label.deadline_step, self.label.onset_step
        flagged = set(self.peers[peer])
        starts = [s for s in sorted(flagged) if s - 1 not in flagged]
        if onset is not None:
            held = [s for s in starts if s < onset]
            # the episode that began before the onset: still up at the onset?
            if held and all(t in flagged for t in range(held[-1], onset + 1)):
                return None
            starts = [s for s in starts if s >= onset]
        hits = [s for s in starts if deadline is not None and s <= deadline]
        return hits[0] if hits else None

    def by_severity(self, severity: str) -> list[str]:
        return sorted(a["rule"] for a in self.alerts if a["severity"] == severity)

    @property
    def span(self) -> int:
        """Steps the excerpt covers (first to last step)."""
        steps = [s.step for s in self.excerpt.steps]
        return max(steps) - min(steps) + 1 if steps else 0

    def advisor_problems(self) -> list[str]:
        """The advisor's pick must precede the deadline and any non-finite loss."""
        if not self.excerpt.checkpoints or self.advisor is None:
            return []
        picked = (self.advisor.get("recommended") or {}).get("step")
        if picked is None:
            return []
        bad = [
            s.step for s in self.excerpt.steps if s.loss is not None and not math.isfinite(s.loss)
        ]
        problems = []
        if self.label.deadline_step is not None and picked >= self.label.deadline_step:
            problems.append(f"advisor picked {picked}, at or after the deadline")
        if bad and picked >= min(bad):
            problems.append(f"advisor picked {picked}, at or after the non-finite loss {min(bad)}")
        return problems

    def problems(self) -> list[str]:
        kind = self.label.kind
        out = self.advisor_problems()
        if kind == "incident":
            if not self.caught():
                out.append(f"no alert by the deadline {self.label.deadline_step} "
                           f"(first: {self.first_alert})")  # fmt: skip
            for peer in self.peers:
                theirs = self.peer_caught(peer)
                if theirs is not None and (self.first_alert is None or self.first_alert > theirs):
                    out.append(f"{peer} flagged it at {theirs}, ampwatch at {self.first_alert}")
        elif kind in ("healthy", "transient") and self.by_severity("critical"):
            out.append(f"critical alert on a {kind} run: {self.by_severity('critical')}")
        return out


def judge_replay(excerpt: Excerpt, label: Label, alerts: list[dict[str, Any]],
                 advisor: dict[str, Any] | None) -> Verdict:  # fmt: skip
    fired = [a for a in alerts if a.get("fired_step") is not None or a.get("status") == "firing"]
    peers = {name: rule(excerpt.steps) for name, rule in PEERS.items()}
    return Verdict(excerpt, label, fired, advisor, peers)


def replay_and_judge(
    excerpt: Excerpt, label: Label, url: str, *, report_floor: bool = True
) -> Verdict:
    """Replay `excerpt` into the collector at `url` and judge what it said."""
    import httpx
    from scenario_catalog import find_run

    client_run_id = replay(excerpt, url, report_floor=report_floor)
    with httpx.Client(base_url=url, timeout=30) as api:
        run = find_run(api, client_run_id)
        alerts = api.get(f"/api/v1/runs/{run['id']}/alerts", params={"limit": 500}).json()
        advisor = None
        if excerpt.checkpoints:
            advisor = api.get(f"/api/v1/runs/{run['id']}/restart-candidates").json()
    return judge_replay(excerpt, label, alerts["alerts"], advisor)


def episodes(flags: list[int]) -> int:
    """Flagged steps as alerts: a run of consecutive flagged steps is one."""
    flagged = set(flags)
    return sum(1 for s in flagged if s - 1 not in flagged)


def false_alert_rates(verdicts: list[Verdict]) -> dict[str, dict[str, float]]:
    """Alerts on healthy excerpts: ampwatch's by severity and each peer's flags, in all and
    per 10,000 healthy steps (the steps the excerpts cover)."""
    healthy = [v for v in verdicts if v.label.kind == "healthy"]
    steps = sum(v.span for v in healthy)
    counts = {
        "ampwatch critical": sum(len(v.by_severity("critical")) for v in healthy),
        "ampwatch warning": sum(len(v.by_severity("warning")) for v in healthy),
    }
    for peer in PEERS:
        counts[peer] = sum(episodes(v.peers[peer]) for v in healthy)
    return {name: {"count": n, "per_10k": 1e4 * n / steps if steps else math.nan,
                   "healthy_steps": steps} for name, n in counts.items()}  # fmt: skip
