"""Training values printed as `key value`, `key: value`, `key=value` or `key = value`,
whatever the script: the generic fallback (``--format generic``), tqdm postfixes
(``--format tqdm``) and the plain forms of DLLogger and of users' own prints.

Each measured field has its names, matched case-insensitively as whole words:

- step: ``step``, ``global_step``, ``iter``, ``iteration``, ``it``, ``Training Iteration``
- loss: ``loss``, ``train loss``, ``train_loss``, ``lm loss``, ``step_loss``, ``total_loss``
  (never ``val loss``, ``eval_loss``, ``valid loss``, ``test loss``, nor ``loss scale``)
- loss scale: ``loss scale``, ``loss_scale``, ``lossscale``, ``scale``, ``cur_scale``
- lr: ``lr``, ``learning rate``, ``learning_rate`` (a list ``lr=[1e-4, ...]``: its first)
- grad norm: ``grad norm``, ``grad_norm``, ``gnorm``, ``gradient norm``
- skipped: ``skipped``, ``overflow`` (a 0/1 flag, True/False, or a counter that rises)
- nan: a loss printed ``nan``/``inf`` is stored non-finite (NaN is a value, not a gap).

A number is anything float() reads as training logs print it (``1.5E-04``, ``nan``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ampwatch.agent.logs.series import NUMBER, Entry, LogStep, Restart, measured_scale

_SEP = r"\s*(?:[:=]\s*|\s+)\[?\s*"
_WORD = r"(?<![A-Za-z0-9_.\-])"


def _field(names: str, value: str = NUMBER) -> re.Pattern[str]:
    return re.compile(_WORD + "(?:" + names + ")" + _SEP + value, re.IGNORECASE)


STEP = _field(r"global[_ ]step|training iteration|iteration|iter|step|it", r"(\d+)(?![.\d])")
LOSS = re.compile(
    _WORD + r"(?<!val )(?<!val_)(?<!eval )(?<!eval_)(?<!valid )(?<!valid_)(?<!test )(?<!test_)"
    r"(?:train[_ ]loss|training[_ ]loss|lm[_ ]loss|step_loss|total_loss|loss)(?![_ ]?scale)"
    + _SEP + NUMBER, re.IGNORECASE)  # fmt: skip
SCALE = _field(r"loss[_ ]?scale|cur_scale|scale")
LR = _field(r"learning[_ ]rate|lr")
NORM = _field(r"grad(?:ient)?[_ ]norm|gnorm")
SKIPPED = _field(r"skipped|overflow", r"(\d+|true|false)")


def _number(pattern: re.Pattern[str], line: str) -> float | None:
    match = pattern.search(line)
    return None if match is None else float(match.group(1))


@dataclass(slots=True)
class Values:
    """The measured fields one line prints (None: not printed)."""

    step: int | None
    loss: float | None
    loss_scale: float | None
    lr: float | None
    grad_norm: float | None
    skipped: str | None

    @property
    def measured(self) -> bool:
        return any(v is not None for v in (self.loss, self.loss_scale, self.grad_norm))


def values(line: str) -> Values:
    """The fields `line` prints."""
    step = STEP.search(line)
    skipped = SKIPPED.search(line)
    return Values(
        None if step is None else int(step.group(1)),
        _number(LOSS, line),
        _number(SCALE, line),
        _number(LR, line),
        _number(NORM, line),
        None if skipped is None else skipped.group(1).lower(),
    )


class SkipFlags:
    """``skipped``/``overflow`` as printed: a flag (0/1, true/false) or a counter. Values
    that stay within 0..1 are a flag; a counter that rises marks the step skipped."""

    def __init__(self) -> None:
        self._count: int | None = None

    def skipped(self, text: str | None) -> bool:
        if text is None:
            return False
        if text in ("true", "false"):
            return text == "true"
        count, before = int(text), self._count
        self._count = count
        if before is None or (count <= 1 and before <= 1):
            return count == 1
        return count > before


def step_of(step: int, found: Values, flags: SkipFlags, number: int) -> LogStep:
    return LogStep(step, loss=found.loss, loss_scale=measured_scale(found.loss_scale),
                   skipped=flags.skipped(found.skipped), grad_norm=found.grad_norm,
                   lr=found.lr, line=number)  # fmt: skip


class GenericParser:
    """Any line that prints a step number and at least one of loss, loss scale, grad
    norm (`values`): plain ``step 100 loss 2.3`` prints, ``Step 100 | loss: 2.3 | lr: 1e-4``
    and the like. A step number below the last one is a new process (the script
    restarted, appending to its log); the same number again is another print of that step
    (the first one is kept)."""

    format = "generic"

    def __init__(self) -> None:
        self.recognised = 0
        self.inferred: dict[str, str] = {}
        self._flags = SkipFlags()
        self._last: int | None = None

    def feed(self, line: str, number: int) -> list[Entry]:
        found = values(line)
        if found.step is None or not found.measured or _validation(line):
            return []
        if found.step == self._last:
            return []  # another print of the same step (a summary line): the first one stands
        self.recognised += 1
        out: list[Entry] = []
        if self._last is not None and found.step < self._last:
            out.append(Restart(number, f"step {found.step} after {self._last}"))
        self._last = found.step
        out.append(step_of(found.step, found, self._flags, number))
        return out

    def finish(self) -> list[Entry]:
        return []


def _validation(line: str) -> bool:
    """An evaluation line ("val loss 2.1 at step 500"): not a training step."""
    lowered = line.lower()
    return ("val" in lowered or "eval" in lowered or "test" in lowered) and LOSS.search(
        line
    ) is None


#: tqdm's bar: ``N/TOTAL [elapsed<left, rate, key=value, ...]``.
_BAR = re.compile(r"(\d+)/(\d+|\?) \[([^\]]*)\]")


class TqdmParser:
    """tqdm bars with a postfix (``50/1000 [00:10<03:10, 5.00it/s, loss=2.34, lr=1e-3]``):
    the step is the bar's counter, the values its postfix. Every ``\\r`` is a redraw:
    the last drawing of a counter wins, and a step is final once a later counter is drawn.
    A bar that starts again (a new epoch's) continues the count of the one before
    (inference, named in `inferred`)."""

    format = "tqdm"

    def __init__(self) -> None:
        self.recognised = 0
        self.inferred: dict[str, str] = {}
        self._flags = SkipFlags()
        self._held: LogStep | None = None
        self._offset = 0
        self._last_counter: int | None = None
        self._last_total: int | None = None

    def feed(self, line: str, number: int) -> list[Entry]:
        out: list[Entry] = []
        for part in line.split("\r"):
            for bar in _BAR.finditer(part):
                found = values(bar.group(3))
                if not found.measured:
                    continue
                self.recognised += 1
                out += self._bar(int(bar.group(1)), bar.group(2), found, number)
        return out

    def _bar(self, counter: int, total: str, found: Values, number: int) -> list[Entry]:
        if self._last_counter is not None and counter < self._last_counter:
            self._offset += self._last_total or self._last_counter
            self.inferred["step"] = ("each new tqdm bar continues the previous bar's count "
                                     "(its total, else its last counter)")  # fmt: skip
        self._last_counter = counter
        self._last_total = int(total) if total.isdigit() else None
        step = self._offset + counter
        record = step_of(step, found, self._flags, number)
        out: list[Entry] = []
        if self._held is not None and self._held.step != step:
            out.append(self._held)
        self._held = record
        return out

    def finish(self) -> list[Entry]:
        held, self._held = self._held, None
        return [held] if held is not None else []
