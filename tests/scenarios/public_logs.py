"""The public-log corpus (`tests/data/public_logs/`, issue 31): training logs as people have
them, run through `ampwatch import` exactly as a user would (the CLI's own `main`, into a
real collector over HTTP), and judged on three things:

- **values**: every value the log prints is stored as printed. What a log "prints" is read by
  this module's own small regexes, one set per shape of log (`TRUTH`), written from the
  log text and independent of the package's parsers; the collector's `/steps` answer is
  compared with it value by value (equal / contradicted / not stored);
- **alerts**: on a healthy log no critical alert, and warnings counted per 10,000 steps;
- **incidents**: the first alert at or before the labeled deadline through `import`, and the
  same verdict through the manual API (`handle.record()` fed by the same parser's steps).

Shared by `test_public_logs.py` and `bench/detection.py --real-logs` (imported by file name).
`manifest.json` keeps each log's provenance and label; `held_back` logs are kept out of any
calibration and reported apart.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).resolve().parents[1] / "data" / "public_logs"

#: A printed number: 2048, 2.0E-04, .5, nan / NAN / NaN, inf, Infinity. Kept apart from the
#: package's `NUMBER` on purpose: this is the independent reading.
_NUM = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[nN][aA][nN]|-?[iI]nf(?:inity)?)"


def _num(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern.replace("NUM", _NUM))


@dataclass(frozen=True)
class Rule:
    """Lines whose step `step` matches carry the `fields` found on the same line (the last
    match of each, so a line with two redrawn progress bars reads as its last one).
    `sticky`: the step holds for the following lines until the next step line (OLMo prints
    one metric per line under a `[step=N/...]` header)."""

    step: re.Pattern[str]
    fields: dict[str, re.Pattern[str]]
    sticky: bool = False


_MEGATRON_STEP = _num(r"iteration\s+(\d+)/\s*\d+")
#: The corpus' `truth` names -> how that shape of log prints its values.
TRUTH: dict[str, list[Rule]] = {
    "speedrun": [Rule(_num(r"^step:(\d+)/\d+ train_loss:"), {"loss": _num(r"train_loss:NUM")})],
    "llmc": [
        Rule(
            _num(r"^s:(\d+) trl:"),
            {"loss": _num(r"trl:NUM"), "lr": _num(r" lr:NUM"), "grad_norm": _num(r" norm:NUM")},
        )
    ],
    "nanogpt": [Rule(_num(r"\biter (\d+): loss"), {"loss": _num(r": loss NUM")})],
    "megatron": [
        Rule(
            _MEGATRON_STEP,
            {
                "loss": _num(r"\blm[ _]loss: NUM"),
                "loss_scale": _num(r"\bloss scale: NUM"),
                "grad_norm": _num(r"\bgrad norm: NUM"),
                "lr": _num(r"\blearning rate: NUM"),
            },
        )
    ],
    "megatron-old": [
        Rule(
            _MEGATRON_STEP,
            {
                "loss": _num(r"\| lm loss NUM"),
                "loss_scale": _num(r"\| loss scale NUM"),
                "lr": _num(r"\| learning rate NUM"),
            },
        )
    ],
    "dllogger": [
        Rule(
            _num(r"Training Iteration: (\d+)"),
            {"loss": _num(r"step_loss : NUM"), "lr": _num(r"learning_rate : NUM")},
        )
    ],
    "tf2-bert": [
        Rule(
            _num(r"\] Step: (\d+) Lr"),
            {"lr": _num(r" Lr NUM"), "loss_scale": _num(r"Loss scale NUM")},
        ),
        Rule(_num(r"Train Step: (\d+)/"), {"loss": _num(r"/ loss = NUM")}),
    ],
    "xlm": [
        Rule(
            _num(r" - +(\d+) - +[\d.]+ sent/s"),
            {"loss": _num(r"MLM-en: +NUM"), "lr": _num(r"model LR: NUM")},
        )
    ],
    "fairseq": [
        Rule(
            _num(r"\bnum_updates (\d+)"),
            {
                "loss": _num(r"\| loss NUM"),
                "lr": _num(r"\| lr NUM"),
                "grad_norm": _num(r"\| gnorm NUM"),
            },
        )
    ],
    "verse": [
        Rule(
            _num(r"train iter: (\d+)"),
            {
                "loss": _num(r"loss_net: NUM"),
                "loss_scale": _num(r"loss_scale: NUM"),
                "grad_norm": _num(r" norm: NUM"),
            },
        )
    ],
    "detectron2": [
        Rule(_num(r"\biter: (\d+) "), {"loss": _num(r"total_loss: NUM"), "lr": _num(r" lr: NUM")})
    ],
    "pccai": [Rule(_num(r"\biter: (\d+),"), {"loss": _num(r", loss: NUM")})],
    "deeplab": [Rule(_num(r"^step (\d+) \t loss"), {"loss": _num(r"loss = NUM")})],
    "ipex": [
        Rule(
            _num(r"\[Iteration (\d+)\]"),
            {"loss": _num(r"Loss is NUM"), "lr": _num(r"learning rate is NUM")},
        )
    ],
    "olmo": [
        Rule(
            _num(r"\[step=(\d+)/"),
            {
                "loss": _num(r"train/CrossEntropyLoss=NUM"),
                "grad_norm": _num(r"optim/total_grad_norm=NUM"),
            },
            sticky=True,
        )
    ],
    "tqdm": [
        Rule(
            _num(r"(\d+)/\d+ \["),
            {
                "loss": _num(
                    r"(?:[ ,\[]|^)(?:step_loss|noise_step_loss"
                    r"|loss|losses/total_loss)[=:] ?NUM"
                ),
                "lr": _num(r"\blr=NUM"),
            },
        )
    ],
    "deepspeed": [Rule(_num(r"\bstep=(\d+), skipped=\d+"), {"lr": _num(r"\blr=\[NUM")})],
    "mmdet": [
        Rule(
            _num(r"\]\[(\d+)/\d+\]"),
            {
                "lr": _num(r"\blr: NUM"),
                "loss": _num(r", loss: NUM"),
                "grad_norm": _num(r"grad_norm: NUM"),
            },
        )
    ],
}
#: DeepSpeed's OVERFLOW line (in any log) names the scale the skipped step ran at; the
#: terminal may have wrapped it (`Attempted loss sc` / `ale: 4096.0`). Its step is not
#: printed: these are compared in order with the stored skipped steps' scales.
ATTEMPTED = _num(r"Attempted loss sc\n?ale: NUM")
FIELDS = ("loss", "loss_scale", "grad_norm", "lr")


@dataclass(frozen=True)
class Printed:
    """What the log prints, read by the corpus' own regexes: (step, field) -> value, and
    the attempted scales of its OVERFLOW lines in log order."""

    values: dict[tuple[int, str], float]
    attempted: list[float]


def _float(text: str) -> float:
    lowered = text.lower()
    if lowered.endswith("infinity"):
        return -math.inf if lowered.startswith("-") else math.inf
    return float(text)


def printed(path: Path, truth: str) -> Printed:
    text = path.read_text(encoding="utf-8")
    values: dict[tuple[int, str], float] = {}
    current: int | None = None
    for line in text.splitlines():
        for rule in TRUTH[truth]:
            steps = rule.step.findall(line)
            if steps:
                current = int(steps[-1])
            elif not rule.sticky:
                continue
            if current is None:
                continue
            for name, pattern in rule.fields.items():
                found = pattern.findall(line)
                if found:
                    values[(current, name)] = _float(found[-1])
            if not rule.sticky:
                current = None
    return Printed(values, [_float(v) for v in ATTEMPTED.findall(text)])


# -- the manifest ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Log:
    name: str
    kind: str  # incident / healthy / transient / unlabeled
    deadline_step: int | None
    held_back: bool
    truth: str
    source: str
    says: str
    inference: str

    @property
    def path(self) -> Path:
        return CORPUS / f"{self.name}.log"


def manifest() -> list[Log]:
    runs = json.loads((CORPUS / "manifest.json").read_text(encoding="utf-8"))["runs"]
    return [
        Log(
            name,
            r["kind"],
            r["deadline_step"],
            r["held_back"],
            r["truth"],
            r["source"],
            r["says"],
            r["inference"],
        )
        for name, r in sorted(runs.items())
    ]


# -- through `ampwatch import` -----------------------------------------------------------------


@dataclass
class Imported:
    """One log through `ampwatch import`: exit status, what it printed, and per run it made
    the stored steps (columns) and alerts."""

    rc: int
    output: str
    steps: dict[str, list[Any]] = field(default_factory=dict)
    alerts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def read(self) -> bool:
        return self.rc == 0 and bool(self.steps.get("step"))


_RUN_LINE = re.compile(r"^run .* \(([0-9a-f]{32})\): ", re.MULTILINE)


def import_log(path: Path, url: str, *, project: str = "public-logs") -> Imported:
    """`ampwatch import PATH --url URL` in this process (the CLI's own `main`), then the
    stored steps and fired alerts of every run it reports."""
    import httpx
    from scenario_catalog import find_run

    from ampwatch.server.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(["import", str(path), "--url", url, "--project", project])
        except SystemExit as exc:  # argparse refusals
            rc = int(exc.code or 0)
    output = out.getvalue() + err.getvalue()
    imported = Imported(rc, output)
    ids = _RUN_LINE.findall(out.getvalue())
    if rc != 0 or not ids:
        return imported
    columns: dict[str, list[Any]] = {}
    with httpx.Client(base_url=url, timeout=60) as api:
        for client_run_id in ids:  # a file with two engines is two runs: columns appended
            run = find_run(api, client_run_id)
            answer = api.get(
                f"/api/v1/runs/{run['id']}/steps", params={"max_points": 1_000_000}
            ).json()
            for name in ("step", "skipped", *FIELDS):
                columns.setdefault(name, []).extend(answer[name])
            alerts = api.get(f"/api/v1/runs/{run['id']}/alerts", params={"limit": 500}).json()
            imported.alerts += [
                a
                for a in alerts["alerts"]
                if a.get("fired_step") is not None or a.get("status") == "firing"
            ]
    imported.steps = columns
    return imported


def _stored(value: Any) -> float | None:
    from ampwatch.agent.wire import decode_float

    return decode_float(value)


def _same(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


@dataclass(frozen=True)
class Values:
    """Printed values against stored ones; `contradicted` lists (step, field, printed,
    stored) where the collector holds another value for a value the log prints."""

    printed: int
    equal: int
    contradicted: list[tuple[int | str, str, float, float]]

    @property
    def not_stored(self) -> int:
        return self.printed - self.equal - len(self.contradicted)


def compare(truth: Printed, imported: Imported) -> Values:
    equal = 0
    contradicted: list[tuple[int | str, str, float, float]] = []
    rows = imported.steps
    at: dict[int, int] = {s: i for i, s in enumerate(rows.get("step", []))}
    for (step, name), value in sorted(truth.values.items()):
        i = at.get(step)
        stored = None if i is None else _stored(rows[name][i])
        if stored is None:
            continue
        if _same(value, stored):
            equal += 1
        else:
            contradicted.append((step, name, value, stored))
    skipped = [_stored(rows["loss_scale"][i]) for i, s in enumerate(rows.get("skipped", [])) if s]
    for n, (value, stored) in enumerate(zip(truth.attempted, skipped, strict=False)):
        if stored is None:
            continue
        if _same(value, stored):
            equal += 1
        else:
            contradicted.append((f"overflow #{n + 1}", "loss_scale", value, stored))
    return Values(len(truth.values) + len(truth.attempted), equal, contradicted)


# -- through the manual API, for the incidents -------------------------------------------------


def manual_first_alert(log: Log, url: str) -> tuple[bool, int | None]:
    """(read, first fired step) with the package's parser's steps sent through
    `handle.record()` (`real_logs.replay`): what a loop instrumented by hand would have
    reported for the same values. read False: the parser refuses the file."""
    import httpx
    from real_logs import Excerpt, replay
    from scenario_catalog import find_run

    from ampwatch.agent.logs.importer import parse_file
    from ampwatch.agent.logs.series import Checkpoint, LogParseError, LogStep

    try:
        parsed = parse_file(log.path)
    except (LogParseError, ValueError):
        return False, None
    steps = [e for e in parsed.entries if isinstance(e, LogStep)]
    checkpoints = [(e.step, e.path) for e in parsed.entries if isinstance(e, Checkpoint)]
    excerpt = Excerpt(log.name, parsed.format, log.source, steps, checkpoints)
    client_run_id = replay(excerpt, url, project="public-logs-manual")
    with httpx.Client(base_url=url, timeout=60) as api:
        run = find_run(api, client_run_id)
        alerts = api.get(f"/api/v1/runs/{run['id']}/alerts", params={"limit": 500}).json()
    fired = [int(a["fired_step"]) for a in alerts["alerts"] if a.get("fired_step") is not None]
    return True, min(fired) if fired else None


# -- the printed values themselves through the manual API -------------------------------------


@dataclass(frozen=True)
class Replayed:
    """A log's printed values (the corpus' own reading) sent through `handle.record()`: what
    the alert engine says of the values themselves, whether or not `import` reads the
    format yet."""

    log: Log
    span: int
    alerts: list[dict[str, Any]]

    def by_severity(self, severity: str) -> list[dict[str, Any]]:
        return [a for a in self.alerts if a["severity"] == severity]

    @property
    def first_alert(self) -> int | None:
        fired = [int(a["fired_step"]) for a in self.alerts if a.get("fired_step") is not None]
        return min(fired) if fired else None


def replay_printed(log: Log, url: str) -> Replayed:
    import httpx
    from real_logs import Excerpt, replay
    from scenario_catalog import find_run

    from ampwatch.agent.logs.series import LogStep

    by_step: dict[int, dict[str, float]] = {}
    for (step, name), value in printed(log.path, log.truth).values.items():
        by_step.setdefault(step, {})[name] = value
    steps = [LogStep(step, **values) for step, values in sorted(by_step.items())]  # type: ignore[arg-type]
    if not steps:
        return Replayed(log, 0, [])
    client_run_id = replay(
        Excerpt(log.name, log.truth, log.source, steps), url, project="public-logs-printed"
    )
    with httpx.Client(base_url=url, timeout=60) as api:
        run = find_run(api, client_run_id)
        alerts = api.get(f"/api/v1/runs/{run['id']}/alerts", params={"limit": 500}).json()
    fired = [a for a in alerts["alerts"] if a.get("fired_step") is not None]
    return Replayed(log, steps[-1].step - steps[0].step + 1, fired)


# -- the verdict -------------------------------------------------------------------------------


@dataclass
class Verdict:
    log: Log
    imported: Imported
    values: Values
    manual: tuple[bool, int | None] | None = None  # incidents only

    def by_severity(self, severity: str) -> list[dict[str, Any]]:
        return [a for a in self.imported.alerts if a["severity"] == severity]

    @property
    def span(self) -> int:
        steps = self.imported.steps.get("step") or []
        return max(steps) - min(steps) + 1 if steps else 0

    @property
    def first_alert(self) -> int | None:
        fired = [
            int(a["fired_step"]) for a in self.imported.alerts if a.get("fired_step") is not None
        ]
        return min(fired) if fired else None

    def caught(self, first: int | None) -> bool:
        deadline = self.log.deadline_step
        return first is not None and deadline is not None and first <= deadline

    def problems(self) -> list[str]:
        """Every bar this log misses, in words (empty: it holds them all)."""
        out = []
        if not self.imported.read:
            said = (self.imported.output.strip().splitlines() or [""])[-1]
            out.append(
                f"not read by ampwatch import (exit {self.imported.rc}): "
                f"{said.split(' (looked for')[0][:240]}"
            )
        if self.values.contradicted:
            out.append(
                f"{len(self.values.contradicted)} printed value(s) contradicted, e.g. "
                f"{self.values.contradicted[:3]}"
            )
        if self.log.kind in ("healthy", "transient") and self.by_severity("critical"):
            rules = sorted({a["rule"] for a in self.by_severity("critical")})
            out.append(f"critical alert on a {self.log.kind} log: {rules}")
        if self.log.kind == "incident":
            if not self.caught(self.first_alert):
                out.append(
                    f"incident not alerted by its deadline {self.log.deadline_step} "
                    f"through import (first alert {self.first_alert})"
                )
            if self.manual is not None and self.caught(self.manual[1]) != self.caught(
                self.first_alert
            ):
                out.append(
                    f"import and the manual API disagree: first alert {self.first_alert}"
                    f" against {self.manual[1]}"
                )
        return out


def judge(log: Log, url: str, *, manual: bool = True) -> Verdict:
    imported = import_log(log.path, url)
    verdict = Verdict(log, imported, compare(printed(log.path, log.truth), imported))
    if manual and log.kind == "incident":
        verdict.manual = manual_first_alert(log, url)
    return verdict


def warnings_per_10k(verdicts: list[Verdict]) -> tuple[int, int, float]:
    """(warnings, healthy steps, per 10,000) over the healthy logs among `verdicts`."""
    healthy = [v for v in verdicts if v.log.kind == "healthy"]
    warnings = sum(len(v.by_severity("warning")) for v in healthy)
    steps = sum(v.span for v in healthy)
    return warnings, steps, (1e4 * warnings / steps if steps else math.nan)


def table(verdicts: list[Verdict]) -> Iterator[str]:
    """The per-file table `bench/detection.py --real-logs` prints."""
    yield (
        f"{'log':44} {'kind':9} {'held':4} {'read':4} {'steps':>6} {'printed':>7} {'equal':>6} "
        f"{'contra':>6} {'n/st':>5} {'crit':>4} {'warn':>4}  first alert / deadline (import | manual)"
    )
    for v in verdicts:
        log, values = v.log, v.values
        incident = ""
        if log.kind == "incident":
            manual = "-" if v.manual is None else (v.manual[1] if v.manual[0] else "unread")
            mark = "caught" if v.caught(v.first_alert) else "MISSED"
            incident = f"{v.first_alert} / {log.deadline_step} {mark} | {manual}"
        yield (
            f"{log.name[:44]:44} {log.kind:9} {'yes' if log.held_back else '':4} "
            f"{'yes' if v.imported.read else 'NO':4} {v.span:>6} {values.printed:>7} "
            f"{values.equal:>6} {len(values.contradicted):>6} {values.not_stored:>5} "
            f"{len(v.by_severity('critical')):>4} {len(v.by_severity('warning')):>4}  {incident}"
        )


def bars(verdicts: list[Verdict]) -> dict[str, bool]:
    _, _, rate = warnings_per_10k(verdicts)
    incidents = [v for v in verdicts if v.log.kind == "incident"]
    return {
        "contradicted = 0 on every log": all(not v.values.contradicted for v in verdicts),
        "0 criticals on healthy/transient logs": all(
            not v.by_severity("critical")
            for v in verdicts
            if v.log.kind in ("healthy", "transient")
        ),
        "<= 1 warning per 10k healthy steps": not (rate > 1.0),
        "every incident caught by its deadline through import": all(
            v.caught(v.first_alert) for v in incidents
        ),
        "import and the manual API agree on every incident": all(
            v.manual is None or v.caught(v.manual[1]) == v.caught(v.first_alert) for v in incidents
        ),
        "every log read by import": all(v.imported.read for v in verdicts),
    }
