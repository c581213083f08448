"""DeepSpeed's own lines, which appear inside Megatron-DeepSpeed, HF Trainer and bare
DeepSpeed logs alike: the fp16 scaler's OVERFLOW line and the engine's `step=N` line.

``OVERFLOW! Rank 0 Skipping step. Attempted loss scale: A, reducing to B``: the attempt ran
at A and was skipped. ``... Attempted loss scale: A, but hysteresis is H. Reducing
hysteresis to H-1`` is a skipped step too (the scale stays at A), and so is ``reducing to
A`` (the floor, or ZeRO's own hysteresis print). FP16_Optimizer prints
``Overflow detected. Skipping step. Attempted loss scale: A, reducing to B``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ampwatch.agent.logs.series import NUMBER

OVERFLOW_MARK = "Skipping step"
_OVERFLOW = re.compile(
    r"(?:OVERFLOW!|Overflow detected\.) (?:Rank (\d+) )?Skipping step\. Attempted loss scale: "
)
_REST = re.compile(NUMBER + r"(?:, reducing to " + NUMBER + r"|, but hysteresis is (\d+))?")
#: Launcher prefixes naming the rank a line came from: `[default3]:`, `[rank3]:`, `3: `.
_RANK_PREFIX = re.compile(r"^\s*\[(?:default|rank)(\d+)\]:|^(\d+): ")
_ENGINE_STEP = re.compile(r"step=(\d+), skipped=(\d+)(?:, lr=\[?" + NUMBER + ")?")
#: FP16_Optimizer's own scale lines (printed by every rank): a skip at X, a growth to Y.
_REDUCING = re.compile(r"Reducing dynamic loss scale from " + NUMBER + " to " + NUMBER)
_INCREASING = re.compile(r"Increasing dynamic loss scale from " + NUMBER + " to " + NUMBER)
#: The scaler's settings as DeepSpeed prints its config (`dynamic_loss_scale_args ....
#: {'init_scale': 65536, 'scale_window': 100, ...}`) or as a `"loss_scale_window": 100` key.
_ARGS = re.compile(r"dynamic_loss_scale_args\s*\.*\s*\{([^}]*)\}")
_ARG = re.compile(r"'(\w+)':\s*" + NUMBER)
_WINDOW_KEY = re.compile(r"[\"']loss_scale_window[\"']\s*:\s*(\d+)")


@dataclass(frozen=True, slots=True)
class Overflow:
    """One OVERFLOW line: the attempted scale, what it was reduced to (None: the
    hysteresis form, the scale stays), the hysteresis before it, the rank that printed
    it (None: no launcher prefix) and the rank the text names (``OVERFLOW! Rank 3``: some
    DeepSpeed versions print it on every rank, each with its own scaler)."""

    attempted: float
    reduced: float | None
    hysteresis: int | None
    rank: int | None
    text_rank: int | None = None

    @property
    def transition(self) -> tuple[float, float | None, int | None]:
        return (self.attempted, self.reduced, self.hysteresis)


def overflow(line: str) -> Overflow | None:
    """The OVERFLOW line's values, or None if `line` is not one (a fast substring check
    first: most lines of a log are not)."""
    if OVERFLOW_MARK not in line:
        return None
    head = _OVERFLOW.search(line)
    if head is None:
        return None
    rest = _REST.match(line, head.end())
    if rest is None:
        return None
    return Overflow(
        float(rest.group(1)),
        None if rest.group(2) is None else float(rest.group(2)),
        None if rest.group(3) is None else int(rest.group(3)),
        _line_rank(line),
        None if head.group(1) is None else int(head.group(1)),
    )


def _line_rank(line: str) -> int | None:
    prefix = _RANK_PREFIX.match(line)
    return None if prefix is None else int(prefix.group(1) or prefix.group(2))


def engine_step(line: str) -> tuple[int, int, float | None] | None:
    """DeepSpeed's `step=N, skipped=K, lr=[...]` progress line: (global step, skipped so
    far, the first param group's lr or None)."""
    if "step=" not in line:
        return None
    match = _ENGINE_STEP.search(line)
    if match is None:
        return None
    lr = None if match.group(3) is None else float(match.group(3))
    return int(match.group(1)), int(match.group(2)), lr


def scale_change(line: str) -> tuple[str, float, float] | None:
    """FP16_Optimizer's ``Reducing dynamic loss scale from X to Y`` ("reduce") or
    ``Increasing dynamic loss scale from X to Y`` ("grow"): (kind, X, Y)."""
    if "dynamic loss scale from" not in line:
        return None
    if (m := _REDUCING.search(line)) is not None:
        return "reduce", float(m.group(1)), float(m.group(2))
    if (m := _INCREASING.search(line)) is not None:
        return "grow", float(m.group(1)), float(m.group(2))
    return None


def scaler_settings(line: str) -> dict[str, float]:
    """The dynamic scaler's settings a config print shows ({} when the line shows none)."""
    if "dynamic_loss_scale_args" in line and (m := _ARGS.search(line)) is not None:
        return {k: float(v) for k, v in _ARG.findall(m.group(1))}
    if "loss_scale_window" in line and (m := _WINDOW_KEY.search(line)) is not None:
        return {"scale_window": float(m.group(1))}
    return {}


class RankCopies:
    """Drops the copies of one OVERFLOW line that other ranks print.

    With launcher prefixes, only the lowest rank seen is kept; without them, the lowest
    rank the text names (``OVERFLOW! Rank 3``), and among its lines a repeat of
    the same transition (same attempted scale, same reduction, same hysteresis) right after
    the first is another rank's copy: one scaler never makes the same transition twice in a
    row, since each one changes its scale or its hysteresis -- except at a floor ("reducing
    to 1" from 1), where repeats are real steps and are kept.
    """

    def __init__(self) -> None:
        self._rank: int | None = None
        self._text_rank: int | None = None
        self._last: tuple[float, float | None, int | None] | None = None

    def keep(self, seen: Overflow) -> bool:
        if seen.rank is not None:
            if self._rank is None or seen.rank < self._rank:
                self._rank = seen.rank
            return seen.rank == self._rank
        if seen.text_rank is not None:  # "OVERFLOW! Rank 3": the lowest rank's scaler only
            if self._text_rank is None or seen.text_rank < self._text_rank:
                self._text_rank = seen.text_rank
            if seen.text_rank != self._text_rank:
                return False
        floor = seen.reduced is not None and seen.reduced == seen.attempted
        copy = self._last == seen.transition and not floor
        self._last = seen.transition
        return not copy

    def boundary(self) -> None:
        """A step marker came between: the next line is a new transition."""
        self._last = None
