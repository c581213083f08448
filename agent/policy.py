"""From alert to action: what the loop does when the collector says a critical alert fires.

The collector answers every ingested batch with the run's firing alerts
(`ampwatch.server.firing`). The sender thread, which posts the batch, reads that answer
(`AlertPolicy.hear`) and sets plain attributes; the training thread only reads them: no
extra request, no host sync, no wait. `watch(..., on_critical=...)` chooses what a
critical alert does:

- `"warn"` (default): log it, once per alert; the loop carries on.
- `"stop"`: set `handle.should_stop`; the loop saves a final checkpoint and stops, then
  exits with `handle.exit_code` (`EXIT_CRITICAL_ALERT`). The integrations do this for you.
- `"raise"`: raise `CriticalAlert` on the training thread at the next step boundary (the
  scaler's `update()`, the first optimizer's `step()`, or `handle.record()`), never from
  the sender thread. Uncaught, the process exits with `EXIT_CRITICAL_ALERT`.
- a callable `(handle, alerts) -> None`: called on the training thread at the next step
  boundary with the new critical alerts.

What cannot come back: offline mode (`offline_file`) never talks to the collector, and
while the collector is down batches are spooled unanswered; the agent says so once, the
loop never waits, and the policy applies at the first answer once the collector returns.

Distributed runs: every rank reports under the run's one id, so every rank's sender hears
the same alerts, but each at its own next flush, so not at the same step. The agent issues
no collective, so it cannot make the ranks agree; a rank that stops alone would hang the
others in their next all-reduce. Under DDP/FSDP, agree in the loop's own collective:

    stop = torch.tensor(float(handle.should_stop), device=device)
    torch.distributed.all_reduce(stop, op=torch.distributed.ReduceOp.MAX)  # every rank
    if stop.item(): save a checkpoint on every rank, then break

(rank 0 always posts step scalars, so the MAX hears an alert within a flush interval).
The Lightning and HF Trainer callbacks do this for you with `on_critical="stop"`: at the
end of every `AGREE_EVERY`-th optimizer step, on every rank (the schedule is the step
number, the same on every rank, so every rank enters the collective at the same step
whatever it heard), through the framework's own mechanism where it has one (Lightning's
`strategy.reduce_boolean_decision`, as its EarlyStopping agrees) and `torch.distributed`
otherwise (the HF Trainer has none); single-process fits act at the next step, with no
collective.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

logger = logging.getLogger("ampwatch.agent")

#: The process exit code of a run stopped for a critical alert: EX_TEMPFAIL of sysexits.h
#: ("a temporary failure; the user is invited to retry"). Distinct from a Python crash (1),
#: a signal (128 + n) and Megatron's rerun codes (16, 17): a launcher that sees it fetches
#: the resume plan (`ampwatch resume-plan RUN --json`) and relaunches from it.
EXIT_CRITICAL_ALERT = 75

#: Under DDP, the framework callbacks agree on a stop every this many optimizer steps (one
#: one-element all-reduce and its host read each time): an alert takes a flush interval or
#: more to come back, so waiting up to 10 steps more adds little; every step would put a
#: host sync into each step of a GPU run.
AGREE_EVERY = 10

Mode = Literal["warn", "stop", "raise"]
MODES: tuple[Mode, ...] = ("warn", "stop", "raise")


@dataclass(frozen=True)
class FiringAlert:
    """An alert firing on the collector, as the ingest acknowledgement carried it."""

    id: int
    rule: str
    #: '' for a run-wide rule, else the layer a per-layer rule fired on.
    layer: str
    severity: str
    #: The step at which it fired.
    step: int | None

    def describe(self) -> str:
        where = f" on {self.layer}" if self.layer else ""
        at = f" at step {self.step}" if self.step is not None else ""
        return f"{self.severity} alert {self.rule}{where}{at} (id {self.id})"


class CriticalAlert(SystemExit):
    """Raised at a step boundary by `on_critical="raise"`. A `SystemExit`, so that a loop's
    `except Exception` does not swallow it and, uncaught, the process exits with
    `EXIT_CRITICAL_ALERT` (`code`); catch it by name to save and stop on your terms."""

    def __init__(self, alerts: tuple[FiringAlert, ...]) -> None:
        super().__init__(EXIT_CRITICAL_ALERT)
        self.alerts = alerts

    def __str__(self) -> str:
        return "ampwatch: " + "; ".join(a.describe() for a in self.alerts)


OnCritical = Mode | Callable[[Any, tuple[FiringAlert, ...]], None]


def check_on_critical(on_critical: object) -> None:
    """ValueError at `watch()` time for anything but a mode or a callable."""
    if not (callable(on_critical) or on_critical in MODES):
        raise ValueError(
            f'on_critical must be "warn", "stop", "raise" or a callable, got {on_critical!r}'
        )


def parse_alerts(body: bytes) -> tuple[FiringAlert, ...] | None:
    """The firing alerts of an ingest acknowledgement's JSON body, or None when it carries
    none (an older collector, an odd body): the previous state stands then."""
    try:
        answer = json.loads(body)
        alerts = answer["alerts"]
        return tuple(
            FiringAlert(
                id=int(a["id"]),
                rule=str(a["rule"]),
                layer=str(a.get("layer") or ""),
                severity=str(a["severity"]),
                step=None if a.get("step") is None else int(a["step"]),
            )
            for a in alerts
        )
    except (ValueError, TypeError, KeyError):
        return None


class AlertPolicy:
    """The run's firing alerts and what to do about a critical one.

    `hear` runs on the sender thread, with each acknowledgement's body; `at_boundary` on the
    training thread at each step boundary, where its fast path is one attribute read.
    """

    def __init__(self, on_critical: OnCritical = "warn", *, ignore: Iterable[int] = ()) -> None:
        check_on_critical(on_critical)
        self._on_critical = on_critical
        #: The firing alerts of the latest acknowledgement (replaced whole: one assignment).
        self.firing: tuple[FiringAlert, ...] = ()
        self.should_stop = False
        #: A critical alert has fired during this process (any mode).
        self.critical_seen = False
        #: Critical alert ids already acted on, or to leave alone: those a resume plan
        #: abandoned (the collector resolves them at the `resumed` event).
        self._acted: set[int] = set(ignore)
        #: New critical alerts the training thread has not acted on ("raise", callable).
        self._due: tuple[FiringAlert, ...] | None = None
        self._lock = threading.Lock()
        self._logged: set[str] = set()

    @property
    def exit_code(self) -> int:
        """`EXIT_CRITICAL_ALERT` once the policy stopped (or raised for) the run, else 0."""
        acting = self._on_critical in ("stop", "raise") or callable(self._on_critical)
        return EXIT_CRITICAL_ALERT if self.critical_seen and acting else 0

    def hear(self, body: bytes) -> None:
        """Sender thread: take an acknowledgement's alerts; act on new critical ones."""
        alerts = parse_alerts(body)
        if alerts is None:
            return
        self.firing = alerts
        new = tuple(a for a in alerts if a.severity == "critical" and a.id not in self._acted)
        if not new:
            return
        self._acted.update(a.id for a in new)
        self.critical_seen = True
        what = "; ".join(a.describe() for a in new)
        if self._on_critical == "warn":
            logger.warning("ampwatch: %s; training continues (on_critical='warn')", what)
            return
        if self._on_critical == "stop":
            self.should_stop = True
            logger.warning(
                "ampwatch: %s; handle.should_stop is set: save a checkpoint and stop "
                "(exit code %d)",
                what,
                EXIT_CRITICAL_ALERT,
            )
            return
        if self._on_critical == "raise":
            self.should_stop = True
        with self._lock:
            self._due = new if self._due is None else (*self._due, *new)

    def at_boundary(self, handle: Any) -> None:
        """Training thread, at a step boundary: raise or call back for new critical alerts."""
        if self._due is None:
            return
        with self._lock:
            due, self._due = self._due, None
        if due is None:
            return
        if self._on_critical == "raise":
            error = CriticalAlert(due)
            logger.error("%s; raising CriticalAlert (exit code %d)", error, EXIT_CRITICAL_ALERT)
            raise error
        assert callable(self._on_critical)
        self._on_critical(handle, due)

    def unanswered(self, why: str) -> None:
        """Say once that no alert can come back (offline mode); a warning when the policy
        would act, else for information."""
        if why not in self._logged:
            self._logged.add(why)
            level = logging.INFO if self._on_critical == "warn" else logging.WARNING
            logger.log(
                level,
                "ampwatch: %s: no alert can come back, on_critical=%r cannot act until the "
                "collector answers; training continues",
                why,
                self._on_critical if not callable(self._on_critical) else "callable",
            )
