"""The HF Trainer's console log, with DeepSpeed's lines inside its tqdm bar.

tqdm redraws its bar with carriage returns, so one physical line holds many bar states
and DeepSpeed's OVERFLOW lines glued to them; every ``\\r`` is a line break here.

- The bar's counter ``N/TOTAL [`` is printed after step N: an OVERFLOW line after counter
  N belongs to step N + 1 (before the first counter: to the first counted step).
- A step's loss scale is the one it attempted, else the one DeepSpeed last reduced to;
  before the first OVERFLOW line the log does not say (None).
- The Trainer's ``{'loss': x, 'learning_rate': y, 'grad_norm': g, ...}`` (an average since
  its last log) belongs to the last counted step.

A step is final once a later counter is printed, so steps stream one bar redraw behind.
"""

from __future__ import annotations

import re

from ampwatch.agent.logs.deepspeed_lines import RankCopies, overflow
from ampwatch.agent.logs.series import NUMBER, Entry, LogStep

_COUNTER = re.compile(r"(\d+)/\d+ \[")
_DICT = re.compile(r"\{'loss': " + NUMBER + r"[^}]*\}")
_DICT_LR = re.compile(r"'learning_rate': " + NUMBER)
_DICT_NORM = re.compile(r"'grad_norm': " + NUMBER)
_OVERFLOW_AT = re.compile(r"(?:OVERFLOW!|Overflow detected\.)")


class HfParser:
    format = "hf"

    def __init__(self) -> None:
        self.recognised = 0
        self.inferred: dict[str, str] = {}
        self._steps: dict[int, LogStep] = {}
        self._last: int | None = None
        self._scale: float | None = None
        self._pending: float | None = None  # an OVERFLOW before the first counter
        self._copies = RankCopies()

    def feed(self, line: str, number: int) -> list[Entry]:
        out: list[Entry] = []
        for part in line.split("\r"):
            out += self._part(part, number)
        return out

    def _part(self, text: str, number: int) -> list[Entry]:
        if "/" not in text and "{'loss'" not in text and "Skipping step" not in text:
            return []
        # A redraw may carry a counter and then an OVERFLOW line: handle them in order.
        cut = _OVERFLOW_AT.search(text)
        head, tail = (text[: cut.start()], text[cut.start() :]) if cut else (text, "")
        out: list[Entry] = []
        for counter in _COUNTER.finditer(head):
            out += self._counter(int(counter.group(1)), number)
        if (loss := _DICT.search(head)) is not None and self._last is not None:
            self.recognised += 1
            step = self._steps[self._last]
            step.loss = float(loss.group(1))
            lr, norm = _DICT_LR.search(loss.group(0)), _DICT_NORM.search(loss.group(0))
            step.lr = float(lr.group(1)) if lr else step.lr
            step.grad_norm = float(norm.group(1)) if norm else step.grad_norm
        if tail and (seen := overflow(tail)) is not None:
            self.recognised += 1
            if self._copies.keep(seen):
                self._overflow(seen.attempted, seen.reduced, number)
        return out

    def _counter(self, n: int, number: int) -> list[Entry]:
        self.recognised += 1
        self._copies.boundary()
        if n not in self._steps:
            self._steps[n] = LogStep(n, loss_scale=self._scale, line=number)
        if self._pending is not None:
            self._steps[n].skipped, self._steps[n].loss_scale = True, self._pending
            self._pending = None
        self._last = n
        final = sorted(s for s in self._steps if s < n)
        return [self._steps.pop(s) for s in final]

    def _overflow(self, attempted: float, reduced: float | None, number: int) -> None:
        self._scale = reduced if reduced is not None else attempted
        if self._last is None:
            self._pending = attempted
        else:
            nxt = self._last + 1
            self._steps[nxt] = LogStep(nxt, loss_scale=attempted, skipped=True, line=number)

    def finish(self) -> list[Entry]:
        if self._pending is not None:
            self._steps[1] = LogStep(1, loss_scale=self._pending, skipped=True)
            self._pending = None
        out: list[Entry] = [self._steps[s] for s in sorted(self._steps)]
        self._steps.clear()
        return out
