"""The tolerant reading of a log: a line that does not read is skipped and counted, never
a reason to refuse the file.

A killed job's log ends in a cut line (``... | learning``), a banner holds a byte that is
not UTF-8, a terminal wraps a long line: each is one line lost, not the run. `LineReader`
feeds a parser line by line and counts what it could not read, by reason, with the first
line numbers; `ampwatch import` prints the count at the end and both `import` and `follow`
store it in the run (a `finding` event, code ``log_lines_unread``), next to what the
parser inferred (code ``log_values_inferred``: each field the log does not print and how
it was filled in).

    reader = LineReader(make_parser("megatron"))
    entries = reader.feed(text, number)   # [] for a line that does not read
    entries += reader.finish()
    print(reader.unread.summary())        # "2 lines not read: 1 cut (line 9), ..."
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ampwatch.agent import wire
from ampwatch.agent.logs.series import Entry, LogParseError, Parser

#: Line numbers kept per reason (the count is exact; the examples are for a person).
EXAMPLES = 5
UNREAD_CODE = "log_lines_unread"
INFERRED_CODE = "log_values_inferred"
#: The replacement character: a byte that was not UTF-8 where the line was decoded.
REPLACED = "\ufffd"


@dataclass
class Unread:
    """Lines not read, by reason: {reason: count} and the first line numbers of each."""

    counts: dict[str, int] = field(default_factory=dict)
    lines: dict[str, list[int]] = field(default_factory=dict)

    def add(self, number: int, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        kept = self.lines.setdefault(reason, [])
        if len(kept) < EXAMPLES:
            kept.append(number)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """One sentence: "3 lines not read: 2 not UTF-8 (lines 4, 9), 1 cut (line 12)"."""
        if not self.total:
            return "every line read"
        parts = []
        for reason, count in sorted(self.counts.items(), key=lambda kv: -kv[1]):
            where = ", ".join(map(str, self.lines[reason]))
            more = ", ..." if count > len(self.lines[reason]) else ""
            parts.append(f"{count} {reason} (line{'s' if count > 1 else ''} {where}{more})")
        return f"{self.total} line{'s' if self.total > 1 else ''} not read: " + "; ".join(parts)

    def event_data(self) -> dict[str, Any]:
        return {"code": UNREAD_CODE, "message": self.summary(), "count": self.total,
                "by_reason": dict(self.counts), "lines": dict(self.lines)}  # fmt: skip


def inferred_data(inferred: dict[str, str]) -> dict[str, Any]:
    """A finding's data naming what the parser inferred (field -> how)."""
    fields = ", ".join(sorted(inferred))
    return {"code": INFERRED_CODE, "message": f"inferred, not printed by the log: {fields}",
            "inferred": dict(inferred)}  # fmt: skip


def findings(unread: Unread, inferred: dict[str, str], step: int | None,
             time: float) -> list[wire.EventRecord]:  # fmt: skip
    """The finding events that say what was not read and what was inferred (none when
    every line was read and nothing inferred)."""
    out: list[wire.EventRecord] = []
    if unread.total:
        out.append({"kind": "finding", "step": step, "time": time, "data": unread.event_data()})
    if inferred:
        out.append({"kind": "finding", "step": step, "time": time,
                     "data": inferred_data(inferred)})  # fmt: skip
    return out


class LineReader:
    """A parser fed tolerantly: a line it cannot read (or cannot decode) is counted in
    `unread` and yields nothing."""

    def __init__(self, parser: Parser) -> None:
        self.parser = parser
        self.unread = Unread()

    @property
    def inferred(self) -> dict[str, str]:
        return getattr(self.parser, "inferred", {})

    def feed(self, text: str, number: int) -> list[Entry]:
        if REPLACED in text:
            self.unread.add(number, "not UTF-8")
            return []
        try:
            return self.parser.feed(text, number)
        except LogParseError as exc:
            self.unread.add(number, exc.reason)
        except ValueError:
            self.unread.add(number, "unreadable value")
        return []

    def finish(self) -> list[Entry]:
        return self.parser.finish()
