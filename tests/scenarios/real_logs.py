"""The real-log corpus (`tests/data/real_logs/`): excerpts of public training logs, parsed
into step series, and the peers' published detectors computed on the same series.

Shared by `test_real_logs.py` and `bench/detection.py` (imported by file name). Each
excerpt keeps its provenance in its `#` header; `labels.json` says only what the source
says happened (an incident with the latest step a monitor may fire, a healthy run, or a
transient that the source says recovered) and marks every inference as one.

The excerpts are parsed by the package's own parsers (`ampwatch.agent.logs`, what
`ampwatch import` runs); each parser's docstring says what it infers. The corpus' `# format:`
header names the shape of the excerpt; `FORMAT_NAMES` maps it to the parser.
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

from ampwatch.agent.logs.importer import iter_lines, parse_lines
from ampwatch.agent.logs.series import NUMBER, Checkpoint, LogStep

CORPUS = Path(__file__).resolve().parents[1] / "data" / "real_logs"


#: One optimizer step (or attempt) as a log shows it; None = the log does not say.
Step = LogStep


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


def load_excerpt(path: Path) -> Excerpt:
    """Parse an excerpt with the package's parser for its `# format:` (`ampwatch import`'s
    own code). The `# ` provenance header is not part of the log and is left out, but for
    a `# scaler:` line, which the DeepSpeed parser reads (its docstring)."""
    data = path.read_bytes()
    header = {m.group(1): m.group(2) for line in data.decode("utf-8").splitlines()
              if (m := re.match(r"# (\w+): (.*)", line))}  # fmt: skip
    lines = [(n, text) for n, text in iter_lines(data)
             if not text.startswith("# ") or text.startswith("# scaler:")]  # fmt: skip
    fmt = FORMAT_NAMES[header["format"]]
    _, _, entries = parse_lines(lines, fmt, str(path))
    steps = [e for e in entries if isinstance(e, Step)]
    checkpoints = [(e.step, e.path) for e in entries if isinstance(e, Checkpoint)]
    floor = header.get("min_loss_scale")
    return Excerpt(path.stem, header["format"], header["source"], steps, checkpoints,
                   float(floor) if floor is not None else None)  # fmt: skip


#: The corpus' `# format:` names (which say what shape of log an excerpt is) -> the
#: package's `--format` names.
FORMAT_NAMES = {"megatron": "megatron", "deepspeed": "deepspeed", "deepspeed-tqdm": "hf",
                "deepspeed-engine": "deepspeed", "fairseq": "fairseq", "apex": "apex"}  # fmt: skip


def logged_attempts(path: Path) -> list[float]:
    """The scales a DeepSpeed log says its overflowed attempts ran at, in order (to check
    the parser's replay of the scaler against)."""
    pattern = re.compile(r"Attempted loss scale: " + NUMBER)
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
