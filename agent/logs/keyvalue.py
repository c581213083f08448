"""Training values printed as `key value`, `key: value`, `key=value` or `key = value`,
whatever the script: the generic fallback (``--format generic``), tqdm postfixes
(``--format tqdm``) and the plain forms of DLLogger and of users' own prints.

Each measured field has its names, matched case-insensitively as whole words:

- step: ``step``, ``global_step``, ``iter``, ``iteration``, ``it``, ``Training Iteration``
- loss: ``loss``, ``train loss``, ``train_loss``, ``lm loss``, ``step_loss``, ``total_loss``
  (never ``val loss``, ``eval_loss``, ``valid loss``, ``test loss``, nor ``loss scale``).
  A line that prints none of these but exactly one other loss-named key (``loss_net``,
  ``noise_step_loss``, ``losses/total_loss``: ``loss_*``, ``*_loss``, ``*/loss``) has that
  key as its loss; with several such keys (``loss_cls``, ``loss_bbox``: parts of a loss
  the line does not total) none is taken: which one the run watches is not for the reader
  to guess.
- loss scale: ``loss scale``, ``loss_scale``, ``lossscale``, ``scale``, ``cur_scale``
- lr: ``lr``, ``learning rate``, ``learning_rate`` (a list ``lr=[1e-4, ...]``: its first)
- grad norm: ``grad norm``, ``grad_norm``, ``gnorm``, ``gradient norm``
- skipped: ``skipped``, ``overflow`` (a 0/1 flag, True/False, or a counter that rises)
- nan: a loss printed ``nan``/``inf`` is stored non-finite (NaN is a value, not a gap).

A separator is ``:``, ``=``, spaces, or `` is `` (BigDL/ipex-llm's ``Loss is Infinity``).
A number is anything float() reads as training logs print it (``1.5E-04``, ``nan``,
``Infinity``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ampwatch.agent.logs.deepspeed_lines import OVERFLOW_MARK, RankCopies, overflow
from ampwatch.agent.logs.series import NUMBER, Entry, LogStep, Restart, measured_scale

_SEP = r"\s*(?:[:=]\s*|\s+is\s+|\s+)\[?\s*"
_VALUE = NUMBER.replace("-?inf", "-?inf(?:inity)?")
_WORD = r"(?<![A-Za-z0-9_.\-])"


def _field(names: str, value: str = _VALUE) -> re.Pattern[str]:
    return re.compile(_WORD + "(?:" + names + ")" + _SEP + value, re.IGNORECASE)


STEP = _field(r"global[_ ]step|training iteration|iteration|iter|step|it", r"(\d+)(?![.\d])")
LOSS = re.compile(
    _WORD + r"(?<!val )(?<!val_)(?<!eval )(?<!eval_)(?<!valid )(?<!valid_)(?<!test )(?<!test_)"
    r"(?:train[_ ]loss|training[_ ]loss|lm[_ ]loss|step_loss|total_loss|loss)(?![_ ]?scale)"
    + _SEP + _VALUE, re.IGNORECASE)  # fmt: skip
#: Other loss-named keys: `loss_net`, `noise_step_loss`, `losses/total_loss` (not a
#: validation loss, not the loss scale).
_OTHER_LOSS = re.compile(
    r"(?<![A-Za-z0-9_.\-])((?:[A-Za-z0-9]+[_/.])*(?:loss(?:es)?[_/.][A-Za-z0-9_/.]*|"
    r"[A-Za-z0-9]+_loss))" + _SEP + _VALUE, re.IGNORECASE)  # fmt: skip
_NOT_A_LOSS = re.compile(r"(?:^|[_/.])(?:val|valid|eval|test)[_/.]|^(?:val|eval|test|valid)_|"
                         r"scale", re.IGNORECASE)  # fmt: skip
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


def other_loss(line: str) -> tuple[str, float] | None:
    """(key, value) of the line's one loss-named key that is not a standard name; None
    when it has none or several (parts of a loss: which one counts is not printed)."""
    found = {m.group(1): m.group(2) for m in _OTHER_LOSS.finditer(line)
             if _NOT_A_LOSS.search(m.group(1)) is None}  # fmt: skip
    if len(found) != 1:
        return None
    [(key, text)] = found.items()
    return key, float(text)


def values(line: str) -> Values:
    """The fields `line` prints."""
    step = STEP.search(line)
    skipped = SKIPPED.search(line)
    loss = _number(LOSS, line)
    if loss is None and "loss" in line.lower() and (other := other_loss(line)) is not None:
        loss = other[1]
    return Values(
        None if step is None else int(step.group(1)),
        loss,
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
        if found.step is None or not found.measured or _validation(line, found):
            return []
        return self._step(found.step, found, number)

    def _step(self, step: int, found: Values, number: int) -> list[Entry]:
        if step == self._last:
            return []  # another print of the same step (a summary line): the first one stands
        self.recognised += 1
        out: list[Entry] = []
        if self._last is not None and step < self._last:
            out.append(Restart(number, f"step {step} after {self._last}"))
        self._last = step
        out.append(step_of(step, found, self._flags, number))
        return out

    def finish(self) -> list[Entry]:
        return []


def _validation(line: str, found: Values) -> bool:
    """An evaluation line ("val loss 2.1 at step 500"): not a training step."""
    lowered = line.lower()
    return ("val" in lowered or "eval" in lowered or "test" in lowered) and found.loss is None


_OVERFLOW_AT = re.compile(r"OVERFLOW!|Overflow detected\.")
#: How far an OVERFLOW line wrapped by a terminal may be cut: before its attempted scale.
_CUT_OVERFLOW = re.compile(r"Skipping step\.(?: Attempted(?: loss(?: s\w*)?)?)?\s*$")


def _cut_overflow(text: str) -> bool:
    """An OVERFLOW line that ends before its numbers (the rest is on the next line)."""
    return _CUT_OVERFLOW.search(text) is not None


def _described(text: str) -> Values:
    """The values of a bar's description (``[loss: 1.2 | ...]:  16%|██  |``), or nothing
    when the text before the bar is not one."""
    if _DESCRIBED.search(text) is None:
        return Values(None, None, None, None, None, None)
    return values(text)


#: tqdm's bar: ``N/TOTAL [elapsed<left, rate, key=value, ...]`` (its end cut off where the
#: terminal wrapped the line: the postfix up to the line's end).
_BAR = re.compile(r"(\d+)/(\d+|\?) \[([^\]]*)(?:\]|$)")
#: A description holding the values instead of a postfix (trlx: ``[losses/total_loss: 1.64
#: | losses/policy_loss: 0.12]:  16%|███  | 1024/6400 [...]``): the text before the bar.
_DESCRIBED = re.compile(r"\|\s*$")


class TqdmParser:
    """tqdm bars with a postfix (``50/1000 [00:10<03:10, 5.00it/s, loss=2.34, lr=1e-3]``):
    the step is the bar's counter, the values its postfix. Every ``\\r`` is a redraw:
    the last drawing of a counter wins, and a step is final once a later counter is drawn.
    A bar that starts again (a new epoch's) continues the count of the one before
    (inference, named in `inferred`). A bar whose postfix holds no value is read from its
    description (trlx: ``[losses/total_loss: 1.64 | ...]:  16%|██ | 1024/6400 [...]``); a
    bar cut by the terminal's wrap is read up to the line's end. DeepSpeed's OVERFLOW lines
    among the bars (glued to a redraw, on their own line, or wrapped onto the next line)
    mark the next counted step skipped at the attempted scale; the scale of other steps is
    not printed (None)."""

    format = "tqdm"

    def __init__(self) -> None:
        self.recognised = 0
        self.inferred: dict[str, str] = {}
        self._flags = SkipFlags()
        self._held: LogStep | None = None
        self._offset = 0
        self._last_counter: int | None = None
        self._last_total: int | None = None
        self._copies = RankCopies()
        self._attempted: float | None = None  # an OVERFLOW line waiting for its step
        self._wrapped = ""  # an OVERFLOW line cut by the terminal, waiting for its end

    def feed(self, line: str, number: int) -> list[Entry]:
        out: list[Entry] = []
        if self._wrapped:
            # The terminal wrapped an OVERFLOW line ("... Attempted loss sc" / "ale: 4096.0,
            # reducing to 2048.0"): its end is this line's start.
            line, self._wrapped = self._wrapped + line, ""
        parts = line.split("\r")
        for index, part in enumerate(parts):
            # A redraw may carry a bar and then DeepSpeed's OVERFLOW line glued to it (no
            # newline between them): the bar first, then the overflow (the next step's).
            cut = _OVERFLOW_AT.search(part) if OVERFLOW_MARK in part else None
            head, tail = (part[: cut.start()], part[cut.start() :]) if cut else (part, "")
            start = 0
            for bar in _BAR.finditer(head):
                found = values(bar.group(3))
                if not found.measured:
                    found = _described(head[start : bar.start()])
                start = bar.end()
                if not found.measured:
                    continue
                self.recognised += 1
                out += self._bar(int(bar.group(1)), bar.group(2), found, number)
            if tail and (seen := overflow(tail)) is not None:
                self.recognised += 1
                if self._copies.keep(seen):
                    out += self._overflow(seen.attempted, number)
            elif tail and index == len(parts) - 1 and _cut_overflow(tail):
                self._wrapped = tail
        return out

    def _bar(self, counter: int, total: str, found: Values, number: int) -> list[Entry]:
        if self._last_counter is not None and counter < self._last_counter:
            self._offset += self._last_total or self._last_counter
            self.inferred["step"] = ("each new tqdm bar continues the previous bar's count "
                                     "(its total, else its last counter)")  # fmt: skip
        self._last_counter = counter
        self._last_total = int(total) if total.isdigit() else None
        step = self._offset + counter
        self._copies.boundary()
        record = step_of(step, found, self._flags, number)
        if self._attempted is not None:  # an OVERFLOW line before the first bar: its step
            record.skipped, record.loss_scale = True, self._attempted
            self._attempted = None
        elif self._held is not None and self._held.skipped and self._held.step >= step:
            if self._held.step > step:
                return []  # a redraw of the counter before the skipped step: nothing new
            record.skipped, record.loss_scale = True, self._held.loss_scale
        out: list[Entry] = []
        if self._held is not None and self._held.step != step:
            out.append(self._held)
        self._held = record
        return out

    def _overflow(self, attempted: float, number: int) -> list[Entry]:
        """tqdm draws counter N after step N: an OVERFLOW line after it is step N + 1's
        (after a skipped step N + 1 not drawn yet: N + 2's; before the first bar: the first
        bar's step). The attempt ran at the printed scale."""
        if self._last_counter is None:
            self._attempted = self._attempted or attempted
            return []
        step = self._offset + self._last_counter + 1
        held = self._held
        if held is not None and held.skipped and held.step >= step:
            step = held.step + 1
        out: list[Entry] = [held] if held is not None else []
        self._held = LogStep(step, loss_scale=attempted, skipped=True, line=number)
        return out

    def finish(self) -> list[Entry]:
        held, self._held = self._held, None
        if self._attempted is not None:  # OVERFLOW lines and no bar after them
            held, self._attempted = LogStep(1, loss_scale=self._attempted, skipped=True), None
        return [held] if held is not None else []


#: mmcv's TextLoggerHook and mmengine's LoggerHook: ``Epoch [E][I/N]`` (``Epoch(train)
#: [E][ I/N]``) for epoch-based runners, ``Iter [I/N]`` (``Iter(train) [ I/N]``) otherwise.
MMDET = re.compile(r"Epoch(?:\(train\))?\s*\[(\d+)\]\s*\[\s*(\d+)/(\d+)\]"
                   r"|Iter(?:\(train\))?\s*\[\s*(\d+)/(\d+)\]")  # fmt: skip


class MmdetParser(GenericParser):
    """OpenMMLab's training lines (mmdet, mmseg, BEVDet...): ``Epoch [1][50/3862]\tlr: ...,
    loss_cls: ..., loss: 0.52, grad_norm: 3.1``. The values are read as the generic reader
    reads them (``loss`` is the line's total; its parts ``loss_*`` are not stored). The
    step of an epoch-based line is (E - 1) * N + I, the runner's global iteration when
    every epoch has N iterations (inference, named in `inferred`); an iteration-based line
    prints it. Restarts and repeated steps as in the generic reader."""

    format = "mmdet"

    def feed(self, line: str, number: int) -> list[Entry]:
        if (m := MMDET.search(line)) is None or "val" in line[: m.start()].lower():
            return []
        found = values(line[m.end() :])
        if not found.measured:
            return []
        if m.group(1) is None:
            return self._step(int(m.group(4)), found, number)
        self.inferred["step"] = ("(epoch - 1) * iterations per epoch + the epoch's "
                                 "iteration, as mmcv's runner counts")  # fmt: skip
        return self._step((int(m.group(1)) - 1) * int(m.group(3)) + int(m.group(2)), found,
                          number)  # fmt: skip
