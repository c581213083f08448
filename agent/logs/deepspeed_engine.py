"""DeepSpeed's engine log, streamed: ``step=N, skipped=K, lr=[...]`` lines (every
`steps_per_print` steps, rank 0) with the fp16 scaler's lines between them.

What the log prints is stored as printed; what it does not is inferred, and each inference
is named in `notes` (sent with the run, see `ampwatch.agent.logs.reader`):

- The printed values: each OVERFLOW line's attempted scale (the skipped attempt's scale)
  and the scale it set (``reducing to B``; the hysteresis form keeps A), FP16_Optimizer's
  ``Reducing``/``Increasing dynamic loss scale from X to Y``, and each `step=` line's step
  number, skip counter and lr (the first param group's).
- Every attempt between two `step=` lines is a step (DeepSpeed counts skipped ones).
  Those lines print how many were skipped (K - K_prev) but not which: a skipped attempt is
  exact where FP16_Optimizer prints ``Grad overflow on iteration i`` (attempt i + 1), else
  placed by its time stamp between the two `step=` lines around it (inference). Before the
  first `step=` line the pace is taken from the log's first time stamp (the process
  start), else the overflows are put first, in order, and the notes say the place is
  unknown.
- The scale of an attempt that did not overflow is never printed by ZeRO's scaler: it is
  the last printed one, held (inference); where the log shows the scaler's window (its
  config print ``dynamic_loss_scale_args``, ``"loss_scale_window"``, or a ``# scaler:
  scale_window=W`` comment line) the growth every W clean attempts is replayed from the
  last printed scale. A later print that differs from what was inferred is counted in the
  notes; the printed value is what is stored at its attempt.
- Ranks: the lowest rank's OVERFLOW lines are read (launcher prefix, or the ``Rank N`` the
  line names); the same transition printed again is another rank's copy (`RankCopies`).

Steps stream at each `step=` line (every attempt up to N is final there: DeepSpeed prints
an attempt's OVERFLOW line before the `step=` line that counts it), so `follow` sends them
as the log grows.
"""

from __future__ import annotations

from dataclasses import dataclass

from ampwatch.agent.logs.deepspeed_lines import Overflow, RankCopies
from ampwatch.agent.logs.series import LogStep


@dataclass(slots=True)
class _Skip:
    """One skipped attempt as the scaler printed it: the attempted scale (None: the log
    prints none and none is known before it), the scale after (None: unchanged), its time
    stamp and, where FP16_Optimizer printed it, its attempt."""

    attempted: float | None
    after: float | None
    time: float | None
    attempt: int | None = None


@dataclass(slots=True)
class _Growth:
    after: float
    time: float | None


class EngineSteps:
    """The engine-mode state machine: `overflow`, `exact`, `change`, then `mark` returns the
    attempts up to the mark's step; `finish` what followed the last mark."""

    def __init__(self, notes: dict[str, str], settings: dict[str, float]) -> None:
        self.notes = notes
        self._settings = settings
        self._copies = RankCopies()
        self._reduce_copies = RankCopies()
        self._skips: list[_Skip] = []  # OVERFLOW lines since the last mark
        self._reduces: list[_Skip] = []  # FP16_Optimizer "Reducing" lines since the last mark
        self._growths: list[_Growth] = []
        self._exact: list[int] = []  # attempts named by "Grad overflow on iteration i"
        self._prev_step = 0
        self._prev_time: float | None = None
        self._prev_skipped = 0
        self._first_time: float | None = None
        self._scale: float | None = settings.get("init_scale")
        self._last_overflow = 0
        self.contradicted = 0
        self.unplaced = 0
        self._rate: float | None = None  # seconds per attempt, the last interval's
        self._growths_printed = False

    # -- what the lines say -------------------------------------------------------------

    @property
    def needs_time(self) -> bool:
        """The log's first time stamp is not known yet (the process start, `_pace`)."""
        return self._first_time is None

    def seen_time(self, stamp: float | None) -> None:
        if stamp is not None and self._first_time is None:
            self._first_time = stamp

    def overflow(self, seen: Overflow, stamp: float | None) -> None:
        if self._copies.keep(seen):
            self._skips.append(_Skip(seen.attempted, seen.reduced, stamp))

    def exact(self, iteration: int) -> None:
        attempt = iteration + 1
        if attempt > self._prev_step and attempt not in self._exact:
            self._exact.append(attempt)

    def change(self, kind: str, before: float, after: float, stamp: float | None) -> None:
        if kind == "grow":
            if not self._growths or self._growths[-1].after != after:  # other ranks' copies
                self._growths.append(_Growth(after, stamp))
            return
        seen = Overflow(before, after, None, None)
        if self._reduce_copies.keep(seen):
            self._reduces.append(_Skip(before, after, stamp))

    # -- placing them -----------------------------------------------------------------

    def mark(self, step: int, skipped: int, lr: float | None, stamp: float | None,
             number: int) -> list[LogStep]:  # fmt: skip
        """The `step=N, skipped=K` line: attempts prev+1..N, final."""
        if step <= self._prev_step:
            return []  # another rank's copy of a step= line already read
        skips = self._skips or self._reduces
        rate = self._pace(skips, step, stamp)
        placed = self._place(skips, step, stamp, rate)
        if skipped - self._prev_skipped != len(placed):
            self.notes["skipped_count"] = (
                "the skip counter of some step= lines differs from the overflow lines "
                "between them; the overflow lines are stored (other ranks' copies dropped)"
            )
        grown = self._grown(step, stamp, rate)
        out = self._attempts(self._prev_step + 1, step, placed, grown)
        if out:
            out[-1].lr, out[-1].line = lr, number
        self._skips, self._reduces, self._growths, self._exact = [], [], [], []
        self._prev_step, self._prev_time, self._prev_skipped = step, stamp, skipped
        return out

    def finish(self) -> list[LogStep]:
        """Overflow lines after the last `step=` line: placed at the last pace when known,
        else one attempt apart; only the skipped attempts are stored (the log does not say
        how many others ran)."""
        skips = self._skips or self._reduces
        self._skips, self._reduces = [], []
        if not skips:
            return []
        placed: dict[int, _Skip] = {}
        at = self._prev_step
        for skip in skips:
            guess = at + 1
            if self._rate and skip.time is not None and self._prev_time is not None:
                guess = self._prev_step + max(1, round((skip.time - self._prev_time) / self._rate))
            at = max(guess, at + 1)
            placed[at] = skip
        self.notes["after_last_step_line"] = (
            "overflow lines after the last step= line: placed by time at the last pace "
            "(no later step is printed); only those skipped attempts are stored"
        )
        return self._attempts(self._prev_step + 1, at, placed, {}, only_skips=True)

    def _pace(self, skips: list[_Skip], step: int, stamp: float | None) -> float | None:
        """Seconds per attempt in this interval: from the previous `step=` line, or for the
        first interval from the log's first time stamp (the process start)."""
        lo = self._prev_step
        start = self._prev_time
        first = self._first_time
        if (start is None and skips and first is not None and stamp is not None
                and all(s.time is None or first < s.time for s in skips)):  # fmt: skip
            start = first
            self.notes["first_overflows"] = (
                "overflows before the first step= line: placed by time, counting from "
                "the log's first time stamp as the process start"
            )
        if start is None or stamp is None or step <= lo or stamp <= start:
            return None
        rate = (stamp - start) / (step - lo)
        if self._prev_time is not None:
            self._rate = rate
        return rate

    def _position(self, when: float | None, step: int, stamp: float | None,
                  rate: float | None) -> int | None:  # fmt: skip
        if rate and when is not None and stamp is not None:
            return step - round((stamp - when) / rate)
        return None

    def _place(self, skips: list[_Skip], step: int, stamp: float | None,
               rate: float | None) -> dict[int, _Skip]:  # fmt: skip
        lo = self._prev_step
        if self._exact:
            attempts = sorted(a for a in self._exact if a <= step)
            if len(skips) < len(attempts):
                self.notes["exact_scales"] = (
                    "some 'Grad overflow on iteration' lines have no OVERFLOW/Reducing line: "
                    "their scale is the last printed one, held; none is stored before the log "
                    "prints one"
                )
            placed = dict(zip(attempts, skips, strict=False))
            for attempt in attempts[len(skips) :]:
                # Never a made-up scale: unknown stays None (issue 31: a 0.0 here was a
                # critical loss_scale_collapse on a healthy DeepSpeed-Chat DPO run).
                placed[attempt] = _Skip(self._scale, None, None)
            return placed
        positions: list[int] = []
        for skip in skips:
            guess = self._position(skip.time, step, stamp, rate)
            if guess is None:
                guess = lo + 1
                self.unplaced += 1
                self.notes["unplaced"] = (
                    "some overflows could not be placed (no time stamp, or no pace before "
                    "the first step= line): put at the first attempts after the previous "
                    "step= line, in order; their place is unknown"
                )
            positions.append(max(guess, lo + 1, positions[-1] + 1 if positions else lo + 1))
        # Too late for the interval: pulled back from its end, keeping the order.
        for i in range(len(positions) - 1, -1, -1):
            limit = step if i == len(positions) - 1 else positions[i + 1] - 1
            positions[i] = min(positions[i], limit)
        return {p: s for p, s in zip(positions, skips, strict=True) if p > lo}

    def _grown(self, step: int, stamp: float | None, rate: float | None) -> dict[int, float]:
        """FP16_Optimizer's printed growths: the attempt after which the scale grew."""
        grown: dict[int, float] = {}
        for growth in self._growths:
            at = self._position(growth.time, step, stamp, rate)
            grown[min(max(at if at is not None else step, self._prev_step + 1), step)] = (
                growth.after
            )
        return grown

    def _attempts(self, first: int, last: int, placed: dict[int, _Skip],
                  grown: dict[int, float], *, only_skips: bool = False) -> list[LogStep]:  # fmt: skip
        window = int(self._settings.get("scale_window") or 0)
        out: list[LogStep] = []
        for attempt in range(first, last + 1):
            skip = placed.get(attempt)
            if skip is not None:
                known = skip.attempted is not None
                if known and self._scale is not None and self._scale != skip.attempted:
                    self.contradicted += 1
                out.append(LogStep(attempt, loss_scale=skip.attempted, skipped=True))
                if skip.after is not None or known:
                    self._scale = skip.after if skip.after is not None else skip.attempted
                self._last_overflow = attempt
                continue
            if not only_skips:
                out.append(LogStep(attempt, loss_scale=self._scale))
            if attempt in grown:
                self._scale = grown[attempt]
            elif (window and not self._growths_printed and self._scale is not None
                  and (attempt - self._last_overflow) % window == 0):  # fmt: skip
                self._scale *= 2
        if grown:
            self._growths_printed = True
        return out
