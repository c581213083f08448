"""NVIDIA DLLogger (DeepLearningExamples): its JSON stream, ``DLLL {"timestamp": ...,
"type": "LOG", "step": [epoch, iteration], "data": {"loss": ...}}``, and its stdout form,
``DLL 2022-04-05 02:22:54.614486 - Training Epoch: 1 Training Iteration: 2872  step_loss :
0.69  learning_rate : 1.58e-05``.

- A step: a LOG record whose step names an iteration (``[epoch, iteration]``, an
  ``int``, or the stdout form's ``Iteration: N`` / ``(epoch, iteration)``) and whose data
  holds a loss, a loss scale or a grad norm. ``[epoch]`` (an epoch's summary),
  ``[]`` (the run's), "PARAMETER" and METADATA records are not steps.
- Where the iteration counts within the epoch (it goes back when the epoch grows), each
  epoch continues the last one's count (inference, named in `inferred`).
- Fields: loss (``loss``, ``train_loss``, ``step_loss``, ``total_loss``, ``*.loss``),
  loss scale (``loss_scale``, ``scale``), lr (``learning_rate``, ``lr``), grad norm
  (``grad_norm``, ``gnorm``), skipped (``overflow``/``skipped`` flags).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ampwatch.agent.logs.keyvalue import SkipFlags, values
from ampwatch.agent.logs.series import Entry, LogParseError, LogStep, measured_scale

_LOSS = ("loss", "train_loss", "step_loss", "total_loss", "training_loss", "train.loss")
_SCALE = ("loss_scale", "scale", "loss scale")
_LR = ("learning_rate", "lr", "learning rate")
_NORM = ("grad_norm", "gnorm", "grad norm")
_SKIP = ("overflow", "skipped")
_TUPLE = re.compile(r" - \((\d+), (\d+)\)")


def _pick(data: dict[str, Any], names: tuple[str, ...]) -> float | None:
    for name in names:
        value = data.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                continue
    return None


class DlloggerParser:
    format = "dllogger"

    def __init__(self) -> None:
        self.recognised = 0
        self.inferred: dict[str, str] = {}
        self._flags = SkipFlags()
        self._epoch: int | None = None
        self._offset = 0
        self._last_in_epoch: int | None = None

    def feed(self, line: str, number: int) -> list[Entry]:
        if "DLLL {" in line:
            return self._json(line, number)
        if "DLL " in line and " - " in line:
            return self._plain(line, number)
        return []

    def _json(self, line: str, number: int) -> list[Entry]:
        try:
            record = json.loads(line[line.index("DLLL {") + 5 :])
        except json.JSONDecodeError:
            raise LogParseError(number, line, "a DLLL record that is not JSON",
                                reason="cut or not JSON") from None  # fmt: skip
        if not isinstance(record, dict) or record.get("type") != "LOG":
            return []
        data, step = record.get("data"), record.get("step")
        if not isinstance(data, dict):
            return []
        if isinstance(step, int) and not isinstance(step, bool):
            epoch, iteration = None, step
        elif (
            isinstance(step, list) and len(step) >= 2 and all(isinstance(v, int) for v in step[:2])
        ):
            epoch, iteration = step[0], step[-1]
        else:
            return []  # an epoch's or the run's summary, or a PARAMETER record
        skipped = next((str(data[k]).lower() for k in _SKIP if k in data), None)
        return self._step(epoch, iteration, _pick(data, _LOSS), _pick(data, _SCALE),
                          _pick(data, _LR), _pick(data, _NORM), skipped, number)  # fmt: skip

    def _plain(self, line: str, number: int) -> list[Entry]:
        found = values(line)
        epoch = None
        if (pair := _TUPLE.search(line)) is not None:
            epoch, iteration = int(pair.group(1)), int(pair.group(2))
        elif found.step is not None:
            iteration = found.step
            m = re.search(r"Epoch: (\d+)", line)
            epoch = int(m.group(1)) if m else None
        else:
            return []
        return self._step(epoch, iteration, found.loss, found.loss_scale, found.lr,
                          found.grad_norm, found.skipped, number)  # fmt: skip

    def _step(self, epoch: int | None, iteration: int, loss: float | None,
              scale: float | None, lr: float | None, norm: float | None,
              skipped: str | None, number: int) -> list[Entry]:  # fmt: skip
        if loss is None and scale is None and norm is None:
            return []
        self.recognised += 1
        last = self._last_in_epoch
        if (epoch is not None and self._epoch is not None and epoch > self._epoch
                and last is not None and iteration <= last):  # fmt: skip
            self._offset += last + 1
            self.inferred["step"] = ("the iteration counts within its epoch: each epoch "
                                     "continues the previous epoch's count")  # fmt: skip
        self._epoch = epoch if epoch is not None else self._epoch
        self._last_in_epoch = iteration
        return [LogStep(self._offset + iteration, loss=loss, loss_scale=measured_scale(scale),
                        skipped=self._flags.skipped(skipped), grad_norm=norm, lr=lr,
                        line=number)]  # fmt: skip

    def finish(self) -> list[Entry]:
        return []
