"""`--format auto`: which parser reads a log, and why, from its first lines.

Each format has marker substrings that only its lines carry; the format whose markers
appear most in the first `SNIFF_LINES` lines wins, in a fixed order of precedence on a tie
(Megatron lines may hold DeepSpeed's, HF bars too: the more specific format first). The
reason names the marker and the first line that carried it, so a wrong guess is easy to
see and override with `--format`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ampwatch.agent.logs.apex import ApexParser
from ampwatch.agent.logs.deepspeed import DeepSpeedParser
from ampwatch.agent.logs.fairseq import FairseqParser, MetaseqParser
from ampwatch.agent.logs.hf import HfParser
from ampwatch.agent.logs.megatron import MegatronParser
from ampwatch.agent.logs.series import Parser


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
}

#: (format, marker) in precedence order.
_MARKERS: tuple[tuple[str, str], ...] = (
    ("metaseq", "actv_norm"),
    ("megatron-deepspeed", "consumed tokens:"),
    ("megatron", "lm loss:"),
    ("megatron", "| loss scale:"),
    ("fairseq", "num_updates"),
    ("fairseq", "overflow detected, setting loss scale"),
    ("hf", "{'loss':"),
    ("hf", "/it]"),
    ("hf", "it/s]"),
    ("hf", "%|"),
    ("deepspeed", "|act_loss:"),
    ("deepspeed", "step="),
    ("apex", "Gradient overflow.  Skipping step"),
    ("apex", "reducing loss scale to"),
)
SNIFF_LINES = 5000
#: DeepSpeed's OVERFLOW line appears in Megatron-DeepSpeed and HF logs too: it decides
#: for bare DeepSpeed only when no other format's marker is found.
_GENERIC = "Skipping step. Attempted loss scale"


def make_parser(name: str) -> Parser:
    try:
        return FORMATS[name]()
    except KeyError:
        raise ValueError(
            f"unknown log format {name!r}; one of: auto, {', '.join(FORMATS)}"
        ) from None


def detect_format(lines: Iterable[str]) -> tuple[str, str]:
    """(format, why) for a log's lines; ValueError when no marker is found.

    >>> detect_format([" iteration 10/ 100 | lm loss: 2.0E+00 | loss scale: 1.0 |"])
    ('megatron', "12 ... ")  # doctest: +SKIP
    """
    counts: dict[str, int] = {}
    first: dict[str, tuple[int, str, str]] = {}
    generic = 0
    for number, line in enumerate(lines, 1):
        if number > SNIFF_LINES:
            break
        hit: set[str] = set()
        for fmt, marker in _MARKERS:
            if fmt not in hit and marker in line:
                hit.add(fmt)
                counts[fmt] = counts.get(fmt, 0) + 1
                first.setdefault(fmt, (number, marker, line.strip()[:80]))
        if _GENERIC in line:
            generic += 1
            first.setdefault("", (number, _GENERIC, line.strip()[:80]))
    if not counts and generic:
        counts["deepspeed"] = generic
        first["deepspeed"] = first[""]
    if not counts:
        raise ValueError(
            f"no line in the first {SNIFF_LINES} carries a known log format's marker "
            f"(looked for: {', '.join(sorted({m for _, m in _MARKERS}))}); pass --format"
        )
    order = [fmt for fmt, _ in _MARKERS]
    # Megatron-DeepSpeed lines are Megatron lines too (counted there already).
    if "megatron-deepspeed" in counts:
        counts["megatron-deepspeed"] = max(counts["megatron-deepspeed"], counts.pop("megatron", 0))
    best = max(counts, key=lambda fmt: (counts[fmt], -order.index(fmt)))
    number, marker, text = first[best] if best in first else first["megatron"]
    others = ", ".join(f"{f} {n}" for f, n in sorted(counts.items()) if f != best)
    if generic and best != "deepspeed":
        others += (", " if others else "") + f"DeepSpeed OVERFLOW lines {generic} (read too)"

    why = (f"{counts[best]} line(s) carry {best} markers, the first {marker!r} on line "
           f"{number} ({text!r})" + (f"; other formats' markers: {others}" if others else ""))  # fmt: skip
    return best, why
