"""nanoGPT's ``train.py``: ``iter N: loss X, time T ms, mfu M%`` every `log_interval`
iterations, ``step N: train loss X, val loss Y`` at each evaluation and ``saving
checkpoint to DIR`` after it.

- The loss is the last micro-step's loss of iteration N, scaled back by the accumulation
  steps (``lossf = loss.item() * gradient_accumulation_steps``): stored as printed; a
  printed ``nan`` is a NaN loss.
- nanoGPT prints no loss scale (its GradScaler is silent), no lr and no grad norm.
- The evaluation line is not a training step (its train loss is an estimate over
  `eval_iters` batches); a checkpoint saved after it holds step N.
- An iteration number below the last one is a new process (``init_from='resume'``).
"""

from __future__ import annotations

import re

from ampwatch.agent.logs.series import NUMBER, Checkpoint, Entry, LogStep, Restart

_ITER = re.compile(r"(?<![\w.])iter (\d+): loss " + NUMBER)
_EVAL = re.compile(r"(?<![\w.])step (\d+): train loss " + NUMBER)
_SAVING = re.compile(r"saving checkpoint to (\S+)")


class NanoGptParser:
    format = "nanogpt"

    def __init__(self) -> None:
        self.recognised = 0
        self.inferred: dict[str, str] = {}
        self._last: int | None = None
        self._eval: int | None = None

    def feed(self, line: str, number: int) -> list[Entry]:
        if "iter " in line and (m := _ITER.search(line)) is not None:
            self.recognised += 1
            step = int(m.group(1))
            out: list[Entry] = []
            if self._last is not None and step <= self._last:
                out.append(Restart(number, f"iter {step} after {self._last}"))
            self._last = step
            out.append(LogStep(step, loss=float(m.group(2)), line=number))
            return out
        if "train loss" in line and (m := _EVAL.search(line)) is not None:
            self.recognised += 1
            self._eval = int(m.group(1))
            return []
        if "saving checkpoint" in line and (m := _SAVING.search(line)) is not None:
            self.recognised += 1
            held = self._eval if self._eval is not None else self._last
            if held is not None:
                return [Checkpoint(held, m.group(1), number)]
        return []

    def finish(self) -> list[Entry]:
        return []
