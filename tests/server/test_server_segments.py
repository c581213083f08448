"""`segments.reduce_at` equals numpy's own `ufunc.reduceat` on every shape it is given."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ampwatch.server.segments import MAX_SIZES, reduce_at

UFUNCS = (np.maximum, np.minimum, np.logical_and, np.logical_or)


@st.composite
def segmented(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int]:
    """A matrix with NaN and ±Inf, an axis, and strictly increasing segment starts from 0:
    equal adjacent segments (a rollup level), mixed sizes (finer rows at the ends), or any."""
    rows, cols = draw(st.integers(1, 40)), draw(st.integers(1, 4))
    cells = st.sampled_from([0.0, 0.5, -2.0, 7.0, np.nan, np.inf, -np.inf])
    values = np.array(draw(st.lists(cells, min_size=rows * cols, max_size=rows * cols)))
    axis = draw(st.integers(0, 1))
    matrix = values.reshape(rows, cols) if axis == 0 else values.reshape(cols, rows)
    if draw(st.booleans()):
        starts = np.arange(0, rows, draw(st.integers(1, 5)))
    else:
        inner = draw(st.sets(st.integers(1, rows - 1), max_size=rows - 1)) if rows > 1 else set()
        starts = np.array([0, *sorted(inner)])
    return matrix, starts.astype(np.intp), axis


@given(segmented(), st.sampled_from(UFUNCS))
def test_reduce_at_equals_numpy_reduceat(
    case: tuple[np.ndarray, np.ndarray, int], ufunc: np.ufunc
) -> None:
    matrix, starts, axis = case
    array = matrix > 0 if ufunc in (np.logical_and, np.logical_or) else matrix
    expected = ufunc.reduceat(array, starts, axis=axis)
    got = reduce_at(ufunc, array, starts, axis)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert np.array_equal(got, expected, equal_nan=array.dtype.kind == "f")


@pytest.mark.parametrize("vector", [False, True])
def test_many_segment_sizes_fall_back_to_reduceat(vector: bool) -> None:
    sizes = np.arange(1, MAX_SIZES + 3)  # more distinct sizes than the block path takes
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.intp)
    matrix = np.random.default_rng(0).random((int(sizes.sum()), 3))
    array = matrix[:, 0] if vector else matrix
    assert np.array_equal(reduce_at(np.maximum, array, starts), np.maximum.reduceat(array, starts))
