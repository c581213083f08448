"""NVIDIA apex amp: ``Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale
to X``. apex prints no step number: the lines are consecutive skipped steps from 1
(inference), each attempted at twice the scale it reduced to (apex's backoff factor 2).
Other lines (the user's own loss prints) carry no step either and are not read."""

from __future__ import annotations

import re

from ampwatch.agent.logs.series import NUMBER, Entry, LogStep

_REDUCING = re.compile(r"reducing loss scale to " + NUMBER)


class ApexParser:
    format = "apex"

    def __init__(self) -> None:
        self.recognised = 0
        self.inferred: dict[str, str] = {}
        self._step = 0

    def feed(self, line: str, number: int) -> list[Entry]:
        if "Gradient overflow" not in line:
            return []
        match = _REDUCING.search(line)
        if match is None:
            return []
        self.recognised += 1
        self._step += 1
        if self._step == 1:
            self.inferred.update(
                step="apex prints no step: the overflow lines are consecutive attempts from 1",
                loss_scale="the attempted scale: twice the one the line reduces to (apex's "
                "backoff factor 2)",
            )
        return [LogStep(self._step, loss_scale=2 * float(match.group(1)), skipped=True,
                        line=number)]  # fmt: skip

    def finish(self) -> list[Entry]:
        return []
