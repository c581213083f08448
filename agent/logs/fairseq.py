"""fairseq and metaseq: ``num_updates`` lines (``train_inner`` / ``train`` / epoch
summaries, as ``| key value |`` text or the JSON log format), ``overflow detected, setting
loss scale to: X`` lines, and ``saved checkpoint PATH (epoch E @ N updates`` lines.

- fairseq does not count an overflowed update in num_updates, so a step here is an
  attempt: num_updates plus the overflows logged so far (inference: each overflow line is
  the attempt after the last one logged; one before any numbered line has no place and is
  dropped). An overflow attempt ran at twice the scale it set (scale factor 2).
- ``loss_scale`` is printed to 3 decimals: a printed 0 (a scale under 0.0005, as a run
  falls toward its minimum 1e-4) is rounded away, not measured; otherwise the exact value
  of the last overflow line is used where it rounds to the printed one.
- An epoch summary repeating the last train_inner step is the same step (skipped); a
  num_updates below the last one is a restart (the process resumed from a checkpoint).
- metaseq (OPT) also logs ``actv_norm``: the final layer's activation norm.
"""

from __future__ import annotations

import json
import re

from ampwatch.agent.logs.series import (
    NUMBER,
    Checkpoint,
    Entry,
    LogParseError,
    LogStep,
    Restart,
    field_pattern,
    find,
    measured_scale,
)

_OVERFLOW = re.compile(r"overflow detected, setting loss scale to: " + NUMBER)
_SAVED = re.compile(r"saved checkpoint (\S+) \(epoch \d+ @ (\d+) updates")
_JSON = re.compile(r"\{.*\}")


def _both(name: str) -> tuple[re.Pattern[str], re.Pattern[str]]:
    return field_pattern(name, "="), field_pattern(name, "")


_UPDATES = _both("num_updates")
_SCALE = _both("loss_scale")
_LOSS_EQ = field_pattern("loss", "=")
_LOSS_BAR = field_pattern("| loss", "")
_LOSS_BARE = field_pattern("loss", "")
_NORM = _both("gnorm")
_LR = _both("lr")
_ACTV = _both("actv_norm")


def _first(patterns: tuple[re.Pattern[str], re.Pattern[str]], line: str) -> float | None:
    value = find(patterns[0], line)
    return value if value is not None else find(patterns[1], line)


class FairseqParser:
    format = "fairseq"

    def __init__(self) -> None:
        self.recognised = 0
        self.inferred: dict[str, str] = {}
        self._skips = 0
        self._exact: float | None = None
        self._last: int | None = None

    def feed(self, line: str, number: int) -> list[Entry]:
        if "overflow detected" in line and (m := _OVERFLOW.search(line)) is not None:
            self.recognised += 1
            new = float(m.group(1))
            self._exact = new
            if self._last is None:
                return []
            self._skips += 1
            self._last += 1
            self.inferred.update(
                step="an attempt: num_updates plus the overflows logged so far (fairseq does "
                "not count an overflowed update)",
                loss_scale="an overflowed attempt's scale: twice the one it set (factor 2)",
            )
            return [LogStep(self._last, loss_scale=2 * new, skipped=True, line=number)]
        if "saved checkpoint" in line and (saved := _SAVED.search(line)) is not None:
            self.recognised += 1
            return [Checkpoint(int(saved.group(2)) + self._skips, saved.group(1), number)]
        if "num_updates" not in line or "valid on" in line:
            return []
        if '"train_num_updates"' in line or '"num_updates"' in line:
            line = self._from_json(line, number)
        try:
            return self._numbered(line, number)
        except ValueError as exc:
            raise LogParseError(number, line, f"unreadable value ({exc})") from None

    def _from_json(self, line: str, number: int) -> str:
        """fairseq's JSON log format, {"train_loss": "816.933", ...}, as `key value` text."""
        found = _JSON.search(line)
        if found is None:
            return line
        try:
            values = json.loads(found.group(0))
        except json.JSONDecodeError:
            raise LogParseError(number, line, "a JSON log record that does not parse") from None
        return " | ".join(f"{k.removeprefix('train_')} {v}" for k, v in values.items())

    def _numbered(self, line: str, number: int) -> list[Entry]:
        updates = _first(_UPDATES, line)
        if updates is None:
            return []
        self.recognised += 1
        printed = _first(_SCALE, line)
        scale = measured_scale(printed)
        if (
            scale is not None
            and self._exact is not None
            and abs(round(self._exact, 3) - scale) < 1e-9
        ):
            scale = self._exact
        loss = find(_LOSS_EQ, line)
        if loss is None:
            loss = find(_LOSS_BAR, line)
        if loss is None and line.startswith("epoch "):
            loss = find(_LOSS_BARE, line)
        step = int(updates) + self._skips
        out: list[Entry] = []
        if self._last is not None and step <= self._last:
            if int(updates) >= self._last - self._skips:
                return []  # an epoch summary repeating the last train_inner step
            out.append(Restart(number, f"num_updates {int(updates)} after {self._last}"))
            self._skips, self._exact = 0, None
            step = int(updates)
        self._last = step
        out.append(LogStep(step, loss=loss, loss_scale=scale, grad_norm=_first(_NORM, line),
                           lr=_first(_LR, line), act_norm=self._act_norm(line),
                           line=number))  # fmt: skip
        return out

    def _act_norm(self, line: str) -> float | None:
        return None

    def finish(self) -> list[Entry]:
        return []


class MetaseqParser(FairseqParser):
    """metaseq keeps fairseq's log lines and adds the final layer's ``actv_norm``."""

    format = "metaseq"

    def _act_norm(self, line: str) -> float | None:
        return _first(_ACTV, line)
