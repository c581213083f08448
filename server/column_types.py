"""Column types that store the same values alike on SQLite and PostgreSQL: NaN and +-Inf
distinct from NULL (`NonFiniteFloat`), text with a NUL (`SafeString`), aware UTC times
(`UTCDateTime`). Every table module's columns use them (`ampwatch.server.models`,
`step_models`, `layer_models`).
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import DateTime, Dialect, Double, String, Text
from sqlalchemy.types import TypeDecorator

from ampwatch.agent.wire import NAN, NON_FINITE, WireFloat


class _RawDouble(Double[float]):
    """Double without SQLAlchemy's float() bind coercion, which would turn 'NaN' back into
    a NaN that SQLite then stores as NULL."""

    def bind_processor(self, dialect: Dialect) -> None:
        return None


class NonFiniteFloat(TypeDecorator[float]):
    """A double column in which NaN, +Inf and -Inf survive, distinct from NULL.

    PostgreSQL's float8 stores all three natively. SQLite keeps +-Inf as REAL but binds a
    NaN as NULL, which would turn "the loss was NaN" into "not measured" -- the very signal
    ampwatch exists for. On SQLite a NaN is therefore written as the text 'NaN' (a REAL
    column keeps text it cannot convert) and read back as float NaN. In SQL on SQLite such
    a value compares greater than every number; compare in Python, not in WHERE clauses.
    """

    impl = _RawDouble
    cache_ok = True

    def process_bind_param(self, value: float | None, dialect: Dialect) -> Any:
        return sqlite_float(value) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> float | None:
        if isinstance(value, str):
            return float(NON_FINITE[value])
        return None if value is None else float(value)


def sqlite_float(value: WireFloat | None) -> float | str | None:
    """A float, or a wire float, as a `NonFiniteFloat` column holds it on SQLite: a NaN as
    the text 'NaN', +-Inf as REAL. Ingest binds step rows with it directly (~70 ns a value;
    decode_float, then a NaN check, cost ~4x that per value of the hottest insert).

    >>> sqlite_float(float("nan")), sqlite_float("NaN"), sqlite_float("-Infinity")
    ('NaN', 'NaN', -inf)
    """
    if type(value) is str:
        return NAN if value == NAN else NON_FINITE[value]
    if isinstance(value, float) and math.isnan(value):
        return NAN
    return value


class SafeString(TypeDecorator[str]):
    """Text from outside (names, a run's end reason, alert messages quoting a finding, a
    delivery error) stored alike on both backends: a NUL character, which PostgreSQL's
    text refuses (a NUL in a run_end reason answered 500 there, and the agent retried the
    batch forever) while SQLite kept it, is stored as U+FFFD on both. Identifiers never
    get here with one (the wire's `Name` refuses it with a 422); free text is kept, marked.

    >>> SafeString().process_bind_param("disk\\x00full", None)
    'disk\\ufffdfull'
    """

    impl = String
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect | None) -> str | None:
        return value.replace("\x00", "\ufffd") if value and "\x00" in value else value


class SafeText(SafeString):
    """`SafeString` without a length."""

    impl = Text
    cache_ok = True


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always timezone-aware UTC in Python, on every backend.

    SQLite has no time zones and hands back naive values; normalising at the column
    boundary keeps comparisons between stored and fresh timestamps from raising.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> Any:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: ampwatch stores aware UTC times")
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> Any:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value
