"""facebookresearch/XLM: ``INFO - 10/04/19 14:41:25 - 0:11:11 -    1135 -   56.12 sent/s -
2143.80 words/s - MLM-en:  7.7416 -  - model LR: 3.8795e-06`` every 5 iterations.

- The step is the printed iteration count (`n_total_iter`).
- The loss: each objective prints its own (``MLM-en``, ``CLM-fr``, ``MT-en-fr``,
  ``AE-en``, ``BT-en-fr-en``, ``PC-...``) and no total. One objective: its loss. Several:
  the first one's, or NaN when any of them is not finite (inference, named in
  `inferred`).
- lr: the first ``... LR:`` printed (``model LR``, or ``encoder LR`` for MT).
- XLM prints no loss scale (apex amp's own overflow lines are not tied to an iteration).
"""

from __future__ import annotations

import math
import re

from ampwatch.agent.logs.series import NUMBER, Entry, LogStep, Restart

_HEAD = re.compile(r" - [\d:]+ -\s+(\d+) -\s+[\d.]+ sent/s")
_LOSS = re.compile(r"(?<![\w-])((?:MLM|CLM|TLM|MT|AE|BT|PC)-[A-Za-z-]+):\s+" + NUMBER)
_LR = re.compile(r"\bLR: " + NUMBER)


class XlmParser:
    format = "xlm"

    def __init__(self) -> None:
        self.recognised = 0
        self.inferred: dict[str, str] = {}
        self._last: int | None = None

    def feed(self, line: str, number: int) -> list[Entry]:
        if "sent/s" not in line or (head := _HEAD.search(line)) is None:
            return []
        losses = [float(v) for _, v in _LOSS.findall(line)]
        lr = _LR.search(line)
        if not losses and lr is None:
            return []
        self.recognised += 1
        step = int(head.group(1))
        loss = losses[0] if losses else None
        if len(losses) > 1:
            self.inferred["loss"] = ("several objectives, no total printed: the first "
                                     "objective's loss, NaN when any is not finite")  # fmt: skip
            if not all(math.isfinite(v) for v in losses):
                loss = math.nan
        out: list[Entry] = []
        if self._last is not None and step <= self._last:
            out.append(Restart(number, f"iteration {step} after {self._last}"))
        self._last = step
        out.append(LogStep(step, loss=loss, lr=None if lr is None else float(lr.group(1)),
                           line=number))  # fmt: skip
        return out

    def finish(self) -> list[Entry]:
        return []
