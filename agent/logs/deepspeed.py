"""Bare DeepSpeed logs: OVERFLOW lines, the engine's `step=N, skipped=K` lines, and
DeepSpeed-Chat's RLHF step lines, where two engines (actor and critic) log into one file.

Three shapes, told apart by the first line that decides (`mode`):

- ``rlhf``: ``epoch: E|step: N|ppo_ep: P|act_loss: a|cri_loss: c`` follows the training of
  step N, so the OVERFLOW lines before it are that step's. Each engine steps once per step,
  so at most one line per engine is that step's; a further one is another rank's copy.
  Which engine overflowed: the one whose scale the line attempted (each engine's scale is
  followed from its own lines), else the one whose scale grew to it, else the actor (it
  steps first). Streamed step by step.
- ``engine``: `step=N` lines count every attempt (skipped ones too). A skipped attempt is
  exact where FP16_Optimizer prints ``Grad overflow on iteration i`` (attempt i + 1);
  otherwise (inference) each OVERFLOW line is placed by its time stamp between the two
  `step=` lines around it. The scale between overflows is DeepSpeed's DynamicLossScaler
  replayed from ``# scaler: init_scale=... scale_window=... delayed_shift=... min_scale=...``
  (a comment line the user may add; else DeepSpeed's defaults). Needs the whole log: read
  at the end (`follow` places these steps when it stops).
- ``bare``: OVERFLOW lines only, one skipped step each, numbered from 1 (inference: the
  log prints no step), with other ranks' copies dropped (`RankCopies`).
"""

from __future__ import annotations

import re
from datetime import datetime

from ampwatch.agent.logs.deepspeed_lines import Overflow, RankCopies, engine_step, overflow
from ampwatch.agent.logs.series import NUMBER, Entry, LogStep

_STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]")
_GRAD_OVERFLOW = re.compile(r"Grad overflow on iteration (\d+)")
_RLHF = re.compile(r"epoch: \d+\|step: (\d+)\|ppo_ep: \d+\|act_loss: " + NUMBER
                   + r"\|cri_loss: " + NUMBER)  # fmt: skip
_SCALER = re.compile(r"^#\s*scaler:\s*(.*)$")
#: DeepSpeed's fp16 defaults: initial_scale_power 16, loss_scale_window 1000,
#: hysteresis 2, min_loss_scale 1.
DEFAULT_SCALER = {"init_scale": 65536.0, "scale_window": 1000.0, "delayed_shift": 2.0,
                  "min_scale": 1.0}  # fmt: skip
ENGINES = ("actor", "critic")


def _seconds(line: str) -> float | None:
    stamp = _STAMP.search(line)
    if stamp is None:
        return None
    when = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")
    return when.timestamp() + int(stamp.group(2)) / 1000


class DeepSpeedParser:
    format = "deepspeed"

    def __init__(self) -> None:
        self.recognised = 0
        self.mode = "bare"
        self._decided = False
        self._copies = RankCopies()
        self._held: list[tuple[Overflow, int, str]] = []  # overflows before the mode is known
        self._times: list[float] = []  # engine mode: each overflow's time stamp
        self._scaler = dict(DEFAULT_SCALER)
        self._marks: list[tuple[int, float]] = []
        self._exact: set[int] = set()
        self._bare_step = 0
        # rlhf: each engine's scale, and which engines overflowed in the current step
        self._scales: dict[str, float | None] = dict.fromkeys(ENGINES)
        self._block: dict[str, tuple[float, int]] = {}

    def feed(self, line: str, number: int) -> list[Entry]:
        if line.startswith("#"):
            if (m := _SCALER.match(line)) is not None:
                pairs = (item.split("=", 1) for item in m.group(1).split() if "=" in item)
                self._scaler.update({k: float(v) for k, v in pairs})
            return []
        if (seen := overflow(line)) is not None:
            self.recognised += 1
            return self._overflow(seen, number, line)
        if "step" not in line and "iteration" not in line:
            return []
        if "|step: " in line and (m := _RLHF.search(line)) is not None:
            self.recognised += 1
            out = self._decide("rlhf")
            return out + self._rlhf_step(int(m.group(1)), float(m.group(2)),
                                         float(m.group(3)), number)  # fmt: skip
        if self.mode != "rlhf" and (mark := engine_step(line)) is not None:
            stamp = _seconds(line)
            if stamp is not None:
                self.recognised += 1
                self._decide("engine")
                self._marks.append((mark[0], stamp))
            return []
        if (m := _GRAD_OVERFLOW.search(line)) is not None and self.mode != "rlhf":
            self.recognised += 1
            self._decide("engine")
            self._exact.add(int(m.group(1)) + 1)
        return []

    def _decide(self, mode: str) -> list[Entry]:
        """The first deciding line fixes the mode; overflows held until then join it."""
        if self._decided:
            return []
        self._decided, self.mode = True, mode
        held, self._held = self._held, []
        out: list[Entry] = []
        for seen, number, line in held:
            out += self._overflow(seen, number, line)
        return out

    def _overflow(self, seen: Overflow, number: int, line: str) -> list[Entry]:
        if not self._decided:
            self._held.append((seen, number, line))
            return []
        if self.mode == "rlhf":
            self._rlhf_overflow(seen)
            return []
        if self.mode == "engine":
            stamp = _seconds(line)
            if stamp is not None:
                self._times.append(stamp)
            return []
        if not self._copies.keep(seen):
            return []
        self._bare_step += 1
        return [LogStep(self._bare_step, loss_scale=seen.attempted, skipped=True, line=number)]

    # -- rlhf ------------------------------------------------------------------------------

    def _rlhf_overflow(self, seen: Overflow) -> None:
        free = [e for e in ENGINES if e not in self._block]
        if not free:
            return  # every engine already overflowed this step: another rank's copy
        engine = next((e for e in free if self._scales[e] == seen.attempted), None)
        if engine is None:
            grew = [e for e in free if (s := self._scales[e]) is not None and s < seen.attempted]
            unknown = [e for e in free if self._scales[e] is None]
            engine = (grew or unknown or free)[0]
        self._block[engine] = (seen.attempted, 0)
        self._scales[engine] = seen.reduced if seen.reduced is not None else seen.attempted

    def _rlhf_step(self, step: int, actor_loss: float, critic_loss: float,
                   number: int) -> list[Entry]:  # fmt: skip
        out: list[Entry] = []
        for engine, loss in zip(ENGINES, (actor_loss, critic_loss), strict=True):
            hit = self._block.get(engine)
            scale = hit[0] if hit is not None else self._scales[engine]
            out.append(LogStep(step, loss=loss, loss_scale=scale, skipped=hit is not None,
                               line=number, engine=engine))  # fmt: skip
        self._block = {}
        return out

    # -- engine ----------------------------------------------------------------------------

    def finish(self) -> list[Entry]:
        if not self._decided:
            self._decided = True
            held, self._held = self._held, []
            out: list[Entry] = []
            for seen, number, line in held:
                out += self._overflow(seen, number, line)
            return out
        if self.mode != "engine" or not (self._marks or self._exact):
            return []
        return list(self._replay())

    def _skipped_attempts(self) -> set[int]:
        if self._exact:
            return set(self._exact)
        marks, skipped = self._marks, set[int]()
        for t in self._times:
            after = next((i for i, (_, tm) in enumerate(marks) if tm >= t), len(marks) - 1)
            hi_step, hi_t = marks[after]
            lo_step, lo_t = marks[after - 1] if after > 0 else (0, None)
            per = (hi_t - lo_t) / (hi_step - lo_step) if lo_t is not None else None
            if per is None and after + 1 < len(marks):
                per = (marks[after + 1][1] - hi_t) / (marks[after + 1][0] - hi_step)
            guess = hi_step - round((hi_t - t) / per) if per else hi_step
            guess = min(max(guess, lo_step + 1), hi_step)
            while guess in skipped and guess < hi_step:
                guess += 1
            while guess in skipped:
                guess -= 1
            skipped.add(guess)
        return skipped

    def _replay(self) -> list[LogStep]:
        """DeepSpeed's DynamicLossScaler, replayed over every attempt."""
        skipped = self._skipped_attempts()
        settings = self._scaler
        scale, window = settings["init_scale"], int(settings["scale_window"])
        shift = int(settings["delayed_shift"])
        hysteresis, last_overflow = shift, 0
        steps = []
        # The last attempt: the last `step=` line's, or the last exact overflow's.
        last = max(self._marks[-1][0] if self._marks else 0, max(self._exact, default=0))
        for attempt in range(1, last + 1):
            steps.append(LogStep(attempt, loss_scale=scale, skipped=attempt in skipped))
            if attempt in skipped:
                if shift == 1 or hysteresis == 1:
                    scale = max(scale / 2, settings["min_scale"])
                else:
                    hysteresis -= 1
                last_overflow = attempt
            elif (attempt - last_overflow) % window == 0:
                hysteresis = shift
                scale *= 2
        return steps
