"""`--format auto`: which parser reads a log, and why.

Each format has markers (substrings, or patterns where a substring would also match other
formats' lines) that only its lines carry. Reading starts at the first line that carries
any marker, however many launcher, NCCL or banner lines come before it, and counts markers
over the next `SNIFF_LINES` lines; the format with the most wins, in a fixed order of
precedence on a tie (Megatron lines may hold DeepSpeed's, HF bars too: the more specific
format first). A log with no marker at all is read by the generic parser when some of its
lines print a step number and a loss (`keyvalue`). The reason names the marker, the first
line that carried it and how many lines before it carried none, so a wrong guess is easy to
see and override with `--format`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from ampwatch.agent.logs.apex import ApexParser
from ampwatch.agent.logs.deepspeed import DeepSpeedParser
from ampwatch.agent.logs.dllogger import DlloggerParser
from ampwatch.agent.logs.fairseq import FairseqParser, MetaseqParser
from ampwatch.agent.logs.hf import HfParser
from ampwatch.agent.logs.keyvalue import MMDET, GenericParser, MmdetParser, TqdmParser, values
from ampwatch.agent.logs.llmc import LlmcParser
from ampwatch.agent.logs.megatron import MegatronParser
from ampwatch.agent.logs.nanogpt import NanoGptParser
from ampwatch.agent.logs.olmo import HEADER as OLMO_HEADER
from ampwatch.agent.logs.olmo import OlmoParser
from ampwatch.agent.logs.series import Parser
from ampwatch.agent.logs.xlm import XlmParser


class _MegatronDeepSpeed(MegatronParser):
    format = "megatron-deepspeed"


#: Every `--format` name (but "auto") and its parser. Megatron-DeepSpeed is Megatron's
#: parser: its OVERFLOW lines are read in both.
FORMATS: dict[str, Callable[[], Parser]] = {
    "megatron": MegatronParser,
    "megatron-deepspeed": _MegatronDeepSpeed,
    "deepspeed": DeepSpeedParser,
    "fairseq": FairseqParser,
    "metaseq": MetaseqParser,
    "hf": HfParser,
    "apex": ApexParser,
    "nanogpt": NanoGptParser,
    "dllogger": DlloggerParser,
    "xlm": XlmParser,
    "llmc": LlmcParser,
    "olmo": OlmoParser,
    "mmdet": MmdetParser,
    "tqdm": TqdmParser,
    "generic": GenericParser,
}

_Marker = str | re.Pattern[str]

#: (format, marker) in precedence order.
_MARKERS: tuple[tuple[str, _Marker], ...] = (
    ("metaseq", "actv_norm"),
    ("megatron-deepspeed", "consumed tokens:"),
    ("megatron", "lm loss:"),
    ("megatron", "| loss scale:"),
    ("megatron", re.compile(r"iteration\s+\d+/\s*\d+ \|.*\| (?:lm loss|loss scale) [-\d.]")),
    ("fairseq", "num_updates"),
    ("fairseq", "overflow detected, setting loss scale"),
    ("dllogger", "DLLL {"),
    ("dllogger", re.compile(r"\bDLL \d{4}-\d\d-\d\d")),
    ("xlm", re.compile(r"sent/s - +[\d.]+ words/s")),
    ("nanogpt", re.compile(r"(?<![\w.])iter \d+: loss ")),
    ("llmc", re.compile(r"^s:\d+ trl:")),
    ("olmo", OLMO_HEADER),
    ("mmdet", MMDET),
    ("tqdm", re.compile(r"\d+/(?:\d+|\?) \[[^\]]*(?:it/s|s/it), [\w ]+=")),
    ("tqdm", re.compile(r"loss[\w/]*[:=] ?[-+\w.]+[^\]]*\]:\s+\d+%\|")),
    ("hf", "{'loss':"),
    ("hf", "/it]"),
    ("hf", "it/s]"),
    ("hf", "%|"),
    ("deepspeed", "|act_loss:"),
    ("deepspeed", re.compile(r"step=\d+, skipped=\d+")),
    ("deepspeed", "Grad overflow on iteration"),
    ("apex", "Gradient overflow.  Skipping step"),
    ("apex", "reducing loss scale to"),
)
SNIFF_LINES = 5000
#: `follow` settles on the generic parser after this many step lines with no format's
#: marker among them (`import` reads the whole sniff window first).
GENERIC_LINES = 10
#: DeepSpeed's OVERFLOW line appears in Megatron-DeepSpeed and HF logs too: it decides
#: for bare DeepSpeed only when no other format's marker is found.
_GENERIC = "Skipping step. Attempted loss scale"
_ORDER = [fmt for fmt, _ in _MARKERS]


def make_parser(name: str) -> Parser:
    try:
        return FORMATS[name]()
    except KeyError:
        raise ValueError(
            f"unknown log format {name!r}; one of: auto, {', '.join(FORMATS)}"
        ) from None


def _hit(marker: _Marker, line: str) -> bool:
    return marker in line if isinstance(marker, str) else marker.search(line) is not None


class Sniffer:
    """Counts markers line by line (`add`), so `follow` can decide as lines arrive without
    reading the held lines again; `decide()` says (format, why) or None (not yet)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.first: dict[str, tuple[int, str, str]] = {}
        self.overflows = 0
        self.generic = 0
        self.lines = 0
        self._start: int | None = None  # the first line that carried a marker

    @property
    def window_full(self) -> bool:
        """SNIFF_LINES lines read since the first marker: counting more changes nothing."""
        return self._start is not None and self.lines - self._start >= SNIFF_LINES

    def add(self, line: str) -> None:
        self.lines += 1
        number = self.lines
        if self.window_full:
            return
        hit: set[str] = set()
        for fmt, marker in _MARKERS:
            if fmt not in hit and _hit(marker, line):
                hit.add(fmt)
                self.counts[fmt] = self.counts.get(fmt, 0) + 1
                self.first.setdefault(fmt, (number, _shown(marker), line.strip()[:80]))
        if _GENERIC in line:
            self.overflows += 1
            self.first.setdefault("", (number, _GENERIC, line.strip()[:80]))
            hit.add("")
        if hit:
            self._start = number if self._start is None else self._start
        elif not self.counts and "loss" in line.lower():
            found = values(line)
            if found.step is not None and found.measured:
                self.generic += 1
                self.first.setdefault("generic", (number, "a step number and a loss",
                                                  line.strip()[:80]))  # fmt: skip

    def decide(self, *, final: bool = True) -> tuple[str, str] | None:
        """(format, why); None when no marker was seen (and, not `final`, while the
        generic lines may still be followed by a format's markers)."""
        counts = dict(self.counts)
        if not counts and self.overflows:
            counts["deepspeed"] = self.overflows
            self.first.setdefault("deepspeed", self.first[""])
        if not counts:
            if self.generic and (final or self.generic >= GENERIC_LINES):
                number, marker, text = self.first["generic"]
                return "generic", (
                    f"no known format's marker; {self.generic} line(s) print {marker}, the "
                    f"first on line {number} ({text!r})"
                )
            return None
        # Megatron-DeepSpeed lines are Megatron lines too (counted there already).
        if "megatron-deepspeed" in counts:
            counts["megatron-deepspeed"] = max(counts["megatron-deepspeed"],
                                               counts.pop("megatron", 0))  # fmt: skip
        best = max(counts, key=lambda fmt: (counts[fmt], -_ORDER.index(fmt)))
        number, marker, text = self.first.get(best) or self.first["megatron"]
        others = ", ".join(f"{f} {n}" for f, n in sorted(counts.items()) if f != best)
        if self.overflows and best != "deepspeed":
            others += (
                ", " if others else ""
            ) + f"DeepSpeed OVERFLOW lines {self.overflows} (read too)"
        skipped = min(n for n, _, _ in self.first.values()) - 1
        noise = f"; {skipped} line(s) before it carry no marker" if skipped else ""
        return best, (f"{counts[best]} line(s) carry {best} markers, the first {marker!r} on "
                      f"line {number} ({text!r}){noise}"
                      + (f"; other formats' markers: {others}" if others else ""))  # fmt: skip


def _shown(marker: _Marker) -> str:
    return marker if isinstance(marker, str) else marker.pattern


def detect_format(lines: Iterable[str]) -> tuple[str, str]:
    """(format, why) for a log's lines; ValueError when no line carries a marker (nor
    prints a step number with a loss).

    >>> detect_format([" iteration 10/ 100 | lm loss: 2.0E+00 | loss scale: 1.0 |"])
    ... # doctest: +ELLIPSIS
    ('megatron', "1 line(s) carry megatron markers, the first 'lm loss:' on line 1 (...)")
    """
    sniffer = Sniffer()
    for line in lines:
        sniffer.add(line)
        if sniffer.window_full:
            break
    decided = sniffer.decide()
    if decided is None:
        raise ValueError(
            f"no line of the {sniffer.lines} read carries a known log format's marker "
            f"(formats: {', '.join(FORMATS)}) or prints a step number with a loss; pass --format"
        )
    return decided
