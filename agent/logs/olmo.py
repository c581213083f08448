"""OLMo's trainer (``olmo/train.py``, ``log_metrics_to_console``): a header line
``[step=N/MAX,epoch=E]`` and then one ``    name=value`` line per metric, numbers printed
with thousands separators (``train/Perplexity=195,153``).

- Read: ``train/CrossEntropyLoss`` (the loss), ``optim/total_grad_norm``,
  ``optim/learning_rate_group0`` (the first param group's lr); other metrics are not
  stored.
- A header without any of them is not a step (never an empty step).
- A step is complete when the next header (or the end of the log) comes: steps stream one
  block behind.
- A step number not above the last one is a new process (a resumed run appending).
"""

from __future__ import annotations

import re

from ampwatch.agent.logs.series import Entry, LogStep, Restart

HEADER = re.compile(r"\[step=(\d+)/\d+")
_METRIC = re.compile(r"^\s+([\w/.]+)=([-+\d,.eE]+|nan|-?inf)\s*$", re.IGNORECASE)
_FIELDS = {
    "train/CrossEntropyLoss": "loss",
    "optim/total_grad_norm": "grad_norm",
    "optim/learning_rate_group0": "lr",
}


class OlmoParser:
    format = "olmo"

    def __init__(self) -> None:
        self.recognised = 0
        self.inferred: dict[str, str] = {}
        self._held: LogStep | None = None
        self._last: int | None = None

    def feed(self, line: str, number: int) -> list[Entry]:
        if "[step=" in line and (head := HEADER.search(line)) is not None:
            self.recognised += 1
            out = self.finish()
            step = int(head.group(1))
            if self._last is not None and step <= self._last:
                out.append(Restart(number, f"step={step} after step={self._last}"))
            self._last = step
            self._held = LogStep(step, line=number)
            return out
        if self._held is None or "=" not in line or (m := _METRIC.match(line)) is None:
            return []
        field = _FIELDS.get(m.group(1))
        if field is not None:
            try:
                value = float(m.group(2).replace(",", ""))
            except ValueError:
                return []
            self.recognised += 1
            setattr(self._held, field, value)
        return []

    def finish(self) -> list[Entry]:
        held, self._held = self._held, None
        if held is None or (held.loss, held.grad_norm, held.lr) == (None, None, None):
            return []  # a header without the metrics read here: not a step
        return [held]
