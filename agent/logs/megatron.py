"""Megatron-LM and Megatron-DeepSpeed: ``iteration N/ M | ... | lm loss: ... | loss scale:
... | grad norm: ... | number of skipped iterations: K | number of nan iterations: J`` lines.

What the lines mean (each seen in the public logs of tests/data/):

- Per-interval lines: with ``--log-interval 10`` one line covers 10 iterations; its loss is
  the interval's average over applied iterations, its counters count the interval, and its
  loss scale is the one in effect after the interval's last step. One step per line, at
  the line's iteration: the log says nothing finer.
- Megatron-DeepSpeed lets DeepSpeed own the scaler, so "number of skipped iterations"
  reads 0 while DeepSpeed's ``OVERFLOW!`` lines (printed during the next iteration, once
  per rank) show the skips: an OVERFLOW line before an iteration line marks that
  iteration skipped, at the scale it attempted, whatever the counter says.
- On a skipped iteration the printed grad norm repeats the last applied one unchanged (it
  was never computed): it is dropped. ``grad norm: 0.000`` (older Megatron-DeepSpeed,
  which did not compute it) is not measured either.
- A missing loss field: Megatron's ``training_log`` adds each applied iteration's loss to
  the interval's sum (a skipped one's only to the nan counter when it is not finite) and
  prints ``key: avg`` only ``if avg > 0.0``. So on a line of a process that printed the
  field before, a missing field means either every iteration of the interval was skipped
  (the skip counter covers the interval, or a one-iteration interval shows a skip by an
  OVERFLOW line or a falling scale: nothing measured, the step is a skip) or the
  average over applied iterations is not > 0: NaN (a bf16 run's NaN, whose counters stay
  0), or exactly 0, which a cross-entropy average never is in practice. The second is
  stored as a NaN loss, named in `inferred` (issue 31: Megatron-LLM #33's Falcon-40B NaN
  showed only as the missing field). "number of nan iterations" > 0 makes the loss NaN
  too (a non-finite loss happened: divergence, not scaling).
- ``loss scale: -1.0`` (no scaler, bf16) is not reported. A scale logged lower than the
  previous consecutive iteration's (OVERFLOW line not in the log) marks a skip at the
  previous scale (inference).
- An iteration number not above the last one, or Megatron's start-up banner after steps,
  is a restart: a new process of the same run.
"""

from __future__ import annotations

import re

from ampwatch.agent.logs.deepspeed_lines import RankCopies, overflow
from ampwatch.agent.logs.series import (
    Checkpoint,
    Entry,
    LogParseError,
    LogStep,
    Restart,
    measured_scale,
)

_ITERATION = re.compile(r"iteration\s+(\d+)\s*/\s*\d+\s*\|")
_SAVING = re.compile(r"sav(?:ing|ed) checkpoint at iteration\s+(\d+) to (\S+)")
_BANNERS = ("using world size:", "> initializing torch distributed")


def _fields(line: str) -> dict[str, str]:
    """Every `| name: value` field of an iteration line, and the older `| name value`
    style (Megatron-LM before 2020: `| lm loss 2.3E+00 | loss scale 4096.0 |`), by string
    splitting (no regex: ~30% faster than a search per field; bench/import.py parses a
    million lines)."""
    fields = {}
    for part in line.split("|"):
        name, colon, value = part.partition(":")
        if colon:
            fields[name.strip()] = value.strip()
        else:
            name, _, value = part.strip().rpartition(" ")
            if name:
                fields[name.strip()] = value
    return fields


#: The fields that make an iteration line a measured step (a line cut before all of them
#: is not one).
_VALUES = ("lm loss", "loss scale", "grad norm", "learning rate", "number of skipped iterations",
           "number of nan iterations")  # fmt: skip


def _value(fields: dict[str, str], name: str) -> float | None:
    """The field's number; None when the line has no such field (ValueError when it has
    one that does not read: "lm loss: 1.2.3E+00" is an unreadable line, not a missing loss)."""
    text = fields.get(name)
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"the {name!r} value {text!r} is not a number") from None


class MegatronParser:
    """Streams steps as their iteration lines arrive (no lookahead)."""

    format = "megatron"

    def __init__(self) -> None:
        self.recognised = 0
        self.inferred: dict[str, str] = {}
        self._attempted: float | None = None  # an OVERFLOW line waiting for its iteration
        self._copies = RankCopies()
        self._last_step: int | None = None
        self._logged_scale: float | None = None
        self._saved: set[int] = set()
        self._banner = False
        self._loss_names: set[str] = set()  # loss fields this process has printed

    def feed(self, line: str, number: int) -> list[Entry]:
        if "iteration" not in line:
            if (seen := overflow(line)) is not None:
                self.recognised += 1
                if self._attempted is None and self._copies.keep(seen):
                    self._attempted = seen.attempted
                return []
            if self._last_step is not None and any(b in line for b in _BANNERS):
                self._banner = True
            return []
        if "checkpoint" in line and (saved := _SAVING.search(line)) is not None:
            self.recognised += 1
            step = int(saved.group(1))
            if step in self._saved:
                return []  # "saving ..." then "successfully saved ...": one save
            self._saved.add(step)
            return [Checkpoint(step, saved.group(2), number)]
        head = _ITERATION.search(line)
        if head is None or "lm loss value" in line:
            return []  # validation lines, other mentions of "iteration"
        self.recognised += 1
        return self._iteration(line, number, int(head.group(1)))

    def _iteration(self, line: str, number: int, step: int) -> list[Entry]:
        if not line.rstrip().endswith("|"):
            # Megatron ends every field with " |": the line was cut (a killed job's last
            # line) or wrapped; what it holds may stop inside a number.
            raise LogParseError(number, line, "an iteration line cut short", reason="cut")
        fields = _fields(line)
        if not any(name in fields for name in _VALUES):
            raise LogParseError(number, line, "an iteration line without values",
                                reason="no value")  # fmt: skip
        try:
            skips = _value(fields, "number of skipped iterations") or 0.0
            nans = _value(fields, "number of nan iterations") or 0.0
            loss = _value(fields, "lm loss")
            logged = measured_scale(_value(fields, "loss scale"))
            norm = _value(fields, "grad norm")
            lr = _value(fields, "learning rate")
        except ValueError as exc:  # a number that does not read
            raise LogParseError(number, line, str(exc), reason="unreadable value") from None
        out: list[Entry] = []
        if self._banner or (self._last_step is not None and step <= self._last_step):
            why = "start-up banner" if self._banner else f"iteration {step} after {self._last_step}"
            out.append(Restart(number, why))
            self._banner, self._logged_scale = False, None
            self._last_step = None
            self._loss_names = set()
        if nans > 0:
            # Megatron averages only finite losses (and prints none when the average is
            # not > 0): a non-finite loss shows only in this counter.
            if loss is not None:
                self.inferred["loss"] = (
                    "NaN where 'number of nan iterations' > 0: Megatron's printed lm loss "
                    "averages only the interval's finite losses"
                )
            loss = float("nan")
        record = LogStep(step, loss=loss, loss_scale=logged, skipped=skips > 0,
                         grad_norm=norm or None, lr=lr, line=number)  # fmt: skip
        if self._attempted is not None:
            record.skipped, record.loss_scale, record.grad_norm = True, self._attempted, None
        elif (
            self._last_step == step - 1
            and logged is not None
            and self._logged_scale is not None
            and logged < self._logged_scale
        ):
            record.skipped, record.loss_scale, record.grad_norm = True, self._logged_scale, None
            self.inferred["skipped"] = ("a scale logged lower than the previous iteration's "
                                        "(no OVERFLOW line) marks a skip at the previous scale")  # fmt: skip
        if loss is not None:
            self._loss_names.add("lm loss")
        elif self._loss_names and not self._all_skipped(step, record.skipped, skips):
            record.loss = float("nan")
            self.inferred["loss"] = (
                "NaN where a line leaves out the lm loss earlier lines printed and not every "
                "iteration of its interval was skipped: Megatron prints a loss only when its "
                "interval average is > 0 (a NaN average is not)"
            )
        self._attempted = None
        self._copies.boundary()
        self._logged_scale = logged
        self._last_step = step
        out.append(record)
        return out

    def _all_skipped(self, step: int, skipped: bool, skips: float) -> bool:
        """Every iteration since the previous line of this process was skipped: the skip
        counter covers the interval, or the interval is one iteration and it was skipped
        (an OVERFLOW line, or a scale logged lower: Megatron-DeepSpeed's counter reads 0)."""
        if self._last_step is None:
            return False
        interval = step - self._last_step
        return skips >= interval or (interval == 1 and skipped)

    def finish(self) -> list[Entry]:
        return []
