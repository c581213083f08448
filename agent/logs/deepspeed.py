"""Bare DeepSpeed logs: OVERFLOW lines, the engine's `step=N, skipped=K` lines, and
DeepSpeed-Chat's RLHF step lines, where two engines (actor and critic) log into one file.

Three shapes, told apart by the first line that decides (`mode`):

- ``rlhf``: ``epoch: E|step: N|ppo_ep: P|act_loss: a|cri_loss: c`` follows the training of
  step N, so the OVERFLOW lines before it are that step's. Each engine steps once per step,
  so at most one line per engine is that step's; a further one is another rank's copy.
  Which engine overflowed: the one whose scale the line attempted (each engine's scale is
  followed from its own lines), else the one whose scale grew to it, else the actor (it
  steps first). Streamed step by step.
- ``engine``: `step=N, skipped=K, lr=[...]` lines count every attempt (skipped ones too);
  read by `deepspeed_engine.EngineSteps`, which stores the printed scales, skip counts and
  lr and names what it infers. Streamed at each `step=` line.
- ``bare``: OVERFLOW lines only, one skipped step each, numbered from 1 (inference: the
  log prints no step), with other ranks' copies dropped (`RankCopies`).
"""

from __future__ import annotations

import re
from datetime import datetime

from ampwatch.agent.logs.deepspeed_engine import EngineSteps
from ampwatch.agent.logs.deepspeed_lines import (
    Overflow,
    RankCopies,
    engine_step,
    overflow,
    scale_change,
    scaler_settings,
)
from ampwatch.agent.logs.series import NUMBER, Entry, LogStep

_STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]")
_GRAD_OVERFLOW = re.compile(r"Grad overflow on iteration (\d+)")
_RLHF = re.compile(r"epoch: \d+\|step: (\d+)\|ppo_ep: \d+\|act_loss: " + NUMBER
                   + r"\|cri_loss: " + NUMBER)  # fmt: skip
_SCALER = re.compile(r"^#\s*scaler:\s*(.*)$")
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
        self.inferred: dict[str, str] = {}
        self.mode = "bare"
        self._decided = False
        self._copies = RankCopies()
        self._held: list[tuple[Overflow, int, str]] = []  # overflows before the mode is known
        self._settings: dict[str, float] = {}
        self._engine = EngineSteps(self.inferred, self._settings)
        self._bare_step = 0
        # rlhf: each engine's scale, and which engines overflowed in the current step
        self._scales: dict[str, float | None] = dict.fromkeys(ENGINES)
        self._block: dict[str, tuple[float, int]] = {}

    def feed(self, line: str, number: int) -> list[Entry]:
        if line.startswith("#"):
            if (m := _SCALER.match(line)) is not None:
                pairs = (item.split("=", 1) for item in m.group(1).split() if "=" in item)
                self._configure({k: float(v) for k, v in pairs}, "a '# scaler:' line")
            return []
        if (seen := overflow(line)) is not None:
            self.recognised += 1
            return self._overflow(seen, number, line)
        if self.mode != "rlhf" and (change := scale_change(line)) is not None:
            self.recognised += 1
            self._engine.change(*change, _seconds(line))
            return []
        if "dynamic_loss_scale_args" in line or "loss_scale_window" in line:
            self._configure(scaler_settings(line), f"the config print on line {number}")
            return []
        if "step" not in line and "iteration" not in line:
            if self._engine_open and self._engine.needs_time and "[" in line:
                self._engine.seen_time(_seconds(line))
            return []
        if "|step: " in line and (m := _RLHF.search(line)) is not None:
            self.recognised += 1
            out = self._decide("rlhf")
            return out + self._rlhf_step(int(m.group(1)), float(m.group(2)),
                                         float(m.group(3)), number)  # fmt: skip
        if self.mode != "rlhf" and (mark := engine_step(line)) is not None:
            self.recognised += 1
            out = self._decide("engine")
            return out + list(self._engine.mark(*mark, _seconds(line), number))
        if (m := _GRAD_OVERFLOW.search(line)) is not None and self.mode != "rlhf":
            self.recognised += 1
            out = self._decide("engine")
            self._engine.exact(int(m.group(1)))
            return out
        if self._engine_open and self._engine.needs_time:
            self._engine.seen_time(_seconds(line))
        return []

    @property
    def _engine_open(self) -> bool:
        return not self._decided or self.mode == "engine"

    def _configure(self, settings: dict[str, float], where: str) -> None:
        if not settings:
            return
        self._settings.update(settings)
        if "scale_window" in settings:
            self.inferred["loss_scale"] = (
                "between printed scales: DeepSpeed's growth replayed from the last printed "
                f"scale every {int(settings['scale_window'])} clean attempts (window from "
                f"{where})"
            )

    def _decide(self, mode: str) -> list[Entry]:
        """The first deciding line fixes the mode; overflows held until then join it."""
        if self._decided:
            return []
        self._decided, self.mode = True, mode
        if mode == "engine":
            self.inferred.setdefault("loss_scale", (
                "between printed scales: the last printed scale held (DeepSpeed's ZeRO "
                "scaler prints no growth and the log shows no scale_window)"))  # fmt: skip
            self.inferred["skipped_position"] = (
                "skipped attempts between two step= lines: exact where 'Grad overflow on "
                "iteration' is printed, else placed by their time stamps"
            )
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
            self._engine.overflow(seen, _seconds(line))
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

    def finish(self) -> list[Entry]:
        if not self._decided:
            self._decided = True
            self.inferred["step"] = ("no step= line: each overflow line is one skipped "
                                     "attempt, numbered from 1 (the log prints no step)")  # fmt: skip
            held, self._held = self._held, []
            out: list[Entry] = []
            for seen, number, line in held:
                out += self._overflow(seen, number, line)
            return out
        if self.mode != "engine":
            return []
        out = list(self._engine.finish())
        if self._engine.contradicted:
            self.inferred["loss_scale_contradicted"] = (
                f"{self._engine.contradicted} overflow line(s) printed an attempted scale "
                "other than the one inferred before it; the printed one is stored"
            )
        return out
