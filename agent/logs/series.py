"""What a parser reads out of a log: steps, checkpoint saves and process restarts.

`None` always means "the log does not say" (never 0): a printed `loss scale: -1.0`, a
fairseq `loss_scale 0` rounded away, a Megatron `grad norm: 0.000` from a version that did
not compute it, all become None, so no rule judges a value nobody measured.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Protocol

#: A number as training logs print it: 2048, 2048.0, 1.5E-04, .5, 8.3e-317, nan, inf.
NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|-?inf)"


@dataclass(slots=True)
class LogStep:
    """One optimizer step (or attempt) as the log shows it. `engine`: which of several
    engines logging into one file (DeepSpeed-Chat's "actor" and "critic"), else ""."""

    step: int
    loss: float | None = None
    loss_scale: float | None = None
    skipped: bool = False
    grad_norm: float | None = None
    lr: float | None = None
    act_norm: float | None = None
    line: int = 0
    engine: str = ""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A "saving checkpoint" line: the step it holds and the path it names."""

    step: int
    path: str
    line: int = 0
    engine: str = ""


@dataclass(frozen=True, slots=True)
class Restart:
    """The training process started again (appending to the same log): a new process of
    the same run, as a resumed agent would report it."""

    line: int
    reason: str


@dataclass(frozen=True, slots=True)
class Finding:
    """Something the reading says about the log itself (lines not read, values
    inferred), sent as a `finding` event at `step` (`ampwatch.agent.logs.reader`)."""

    step: int | None
    data: dict[str, Any]
    engine: str = ""


Entry = LogStep | Checkpoint | Restart | Finding


class LogParseError(ValueError):
    """A line that looks like the format's but does not read; names the file and line."""

    def __init__(self, line: int, text: str, why: str, path: str = "", *,
                 reason: str = "unreadable") -> None:  # fmt: skip
        self.line, self.text, self.why, self.path = line, text, why, path
        #: A short category for counting skipped lines ("cut", "unreadable", ...).
        self.reason = reason
        where = f"{path}:{line}" if path else f"line {line}"
        super().__init__(f"{where}: {why}: {text[:200]!r}")


class Parser(Protocol):
    """A line-at-a-time parser. `feed` takes one complete line (no newline) and its
    1-based number, and returns what is known for sure so far; `finish` what is left at the
    end of the log. `recognised` counts the lines that were the format's."""

    format: str
    recognised: int
    #: What the parser filled in that the log does not print: field -> how (named in the
    #: stored run, `ampwatch.agent.logs.reader`).
    inferred: dict[str, str]

    def feed(self, line: str, number: int) -> list[Entry]: ...

    def finish(self) -> list[Entry]: ...


def number(text: str | None) -> float | None:
    """A printed number, or None when absent."""
    return None if text is None else float(text)


def measured_scale(value: float | None) -> float | None:
    """`loss scale: -1.0` (and any non-positive or non-finite print) means "not reported":
    Megatron prints -1 without a scaler, fairseq a rounded 0."""
    if value is None or not math.isfinite(value) or value <= 0:
        return None
    return value


def field_pattern(name: str, sep: str = ":") -> re.Pattern[str]:
    """The compiled `name<sep> value` pattern (compiled once per field, at import)."""
    return re.compile(re.escape(name) + r"\s*" + re.escape(sep) + r"\s*" + NUMBER)


def find(pattern: re.Pattern[str], line: str) -> float | None:
    match = pattern.search(line)
    return float(match.group(1)) if match else None
