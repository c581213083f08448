"""The packed per-step layer arrays of `layer_stats.values`, in and out.

A row is little-endian float64, one value per layer of the run, indexed by `layers.idx`.
A layer absent from the record holds `MISSING_BITS`, a quiet NaN with a payload no float
arithmetic or parser produces, so "not measured" (null over HTTP) and "measured NaN"
("NaN" over HTTP) stay distinct in a column type that has no NULL per element. Rows
written before a run's later layers appeared are shorter; reading pads them with MISSING.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ampwatch.agent.wire import INFINITY, NAN, NEG_INFINITY, WireFloat

MISSING_BITS = np.uint64(0x7FF8_0000_0000_0A3F)
_DTYPE_BITS = np.dtype("<u8")


def pack_row(
    n_layers: int, parts: list[tuple[npt.NDArray[np.intp], npt.NDArray[np.float64]]]
) -> bytes:
    """Pack `(layer indices, values)` pairs into one row of `n_layers`; later parts win.

    >>> import numpy as np
    >>> len(pack_row(3, [(np.array([2]), np.array([0.5]))]))
    24
    """
    bits = np.full(n_layers, MISSING_BITS, dtype=_DTYPE_BITS)
    for indices, values in parts:
        bits[indices] = values.astype("<f8", copy=False).view(_DTYPE_BITS)
    return bits.tobytes()


def unpack_matrix(
    rows: list[bytes], n_layers: int
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]:
    """Stack packed rows into a (rows x n_layers) float matrix and its missing-value mask."""
    bits = np.full((len(rows), n_layers), MISSING_BITS, dtype=_DTYPE_BITS)
    for i, row in enumerate(rows):
        stored = np.frombuffer(row, dtype=_DTYPE_BITS)[:n_layers]
        bits[i, : stored.size] = stored
    missing = bits == MISSING_BITS
    return bits.view(np.float64), missing


def to_wire_rows(
    values: npt.NDArray[np.float64], missing: npt.NDArray[np.bool_]
) -> list[list[WireFloat | None]]:
    """The matrix as JSON-ready nested lists: numbers, non-finite strings, None for missing."""
    finite = np.isfinite(values)
    if finite.all():
        return values.tolist()  # type: ignore[no-any-return]
    out = values.astype(object)
    out[np.isnan(values)] = NAN
    out[np.isposinf(values)] = INFINITY
    out[np.isneginf(values)] = NEG_INFINITY
    out[missing] = None
    return out.tolist()  # type: ignore[no-any-return]
