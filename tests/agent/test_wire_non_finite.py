"""The wire's NaN/±Inf convention, pinned where every side reads it: the agent's encoders,
the collector's nested-data encoder, packed rows and the SQLite storage rule."""

from __future__ import annotations

import json
import math

import numpy as np

from ampwatch.agent import wire
from ampwatch.server.column_types import sqlite_float
from ampwatch.server.packed import to_wire_rows

VALUES = [1.5, math.nan, math.inf, -math.inf, 0.0]
ENCODED = [1.5, "NaN", "Infinity", "-Infinity", 0.0]


def test_the_spellings_and_their_round_trip() -> None:
    assert (wire.NAN, wire.INFINITY, wire.NEG_INFINITY) == ("NaN", "Infinity", "-Infinity")
    assert [wire.encode_float(v) for v in VALUES] == ENCODED
    assert wire.encode_floats(VALUES) == ENCODED
    decoded = [wire.decode_float(v) for v in ENCODED]
    assert math.isnan(decoded[1]) and decoded[2:] == [math.inf, -math.inf, 0.0]
    assert wire.encode_float(None) is None and wire.decode_float(None) is None


def test_nested_event_data_becomes_strict_json() -> None:
    data = {"scale": math.inf, "history": [1.0, {"loss": math.nan}], "note": "NaN", "n": 3}
    encoded = wire.encode_nested(data)
    assert encoded == {
        "scale": "Infinity",
        "history": [1.0, {"loss": "NaN"}],
        "note": "NaN",
        "n": 3,
    }
    json.dumps(encoded, allow_nan=False)  # raises if any non-finite float were left


def test_packed_rows_answer_with_the_same_spellings_and_null_for_missing() -> None:
    values = np.array([VALUES], dtype=np.float64)
    missing = np.array([[False, False, False, False, True]])
    assert to_wire_rows(values, missing) == [[*ENCODED[:4], None]]


def test_sqlite_keeps_nan_as_text_and_infinities_as_numbers() -> None:
    assert [sqlite_float(v) for v in ENCODED] == [1.5, "NaN", math.inf, -math.inf, 0.0]
    assert sqlite_float(math.nan) == "NaN" and sqlite_float(None) is None
