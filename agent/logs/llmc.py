"""llm.c's log file (``-o DIR``, ``main.log``) and the NanoGPT speedrun scripts that kept
its shape: ``s:N trl:X`` per training step, ``lr:Y norm:G`` after it in newer llm.c
(``s:%d trl:%.4f lr:%.6f norm:%.2f``), ``train_time:...`` in the speedrun's, and
``s:N tel:X`` (validation) or ``s:N eval:X`` (HellaSwag) lines that are not training steps.

- The loss is the step's mean training loss as printed; C's ``nan``/``-nan`` is a NaN loss.
- llm.c prints no loss scale (bf16, no scaler) and no skip counter.
- A step number not above the last one is a new process (a resumed run appending).
"""

from __future__ import annotations

import re

from ampwatch.agent.logs.series import NUMBER, Entry, LogStep, Restart

_NUM = NUMBER.replace("|nan|", "|-?nan|")
_TRAIN = re.compile(r"^s:(\d+) trl:" + _NUM)
_LR = re.compile(r" lr:" + _NUM)
_NORM = re.compile(r" norm:" + _NUM)


def _find(pattern: re.Pattern[str], line: str) -> float | None:
    match = pattern.search(line)
    return None if match is None else float(match.group(1))


class LlmcParser:
    format = "llmc"

    def __init__(self) -> None:
        self.recognised = 0
        self.inferred: dict[str, str] = {}
        self._last: int | None = None

    def feed(self, line: str, number: int) -> list[Entry]:
        if not line.startswith("s:") or (m := _TRAIN.match(line)) is None:
            return []  # tel:/eval: lines are evaluations, not steps
        self.recognised += 1
        step = int(m.group(1))
        out: list[Entry] = []
        if self._last is not None and step <= self._last:
            out.append(Restart(number, f"s:{step} after s:{self._last}"))
        self._last = step
        out.append(LogStep(step, loss=float(m.group(2)), lr=_find(_LR, line),
                           grad_norm=_find(_NORM, line), line=number))  # fmt: skip
        return out

    def finish(self) -> list[Entry]:
        return []
