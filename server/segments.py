"""Reductions over consecutive segments of a matrix's rows or columns: the buckets of a
downsampled heatmap or layer series (ingest's rollups reduce a batch's few rows, where
numpy's `reduceat` is as fast: 9 against 27 us for 4 rows of 500 layers).

`ufunc.reduceat` does this, but along the rows of a matrix numpy 2.4 runs it ~20x slower
than a reduction over a reshaped block (a 1,954 x 1,000 matrix into pairs of rows: 23 ms
against 1.2 ms here): it was a quarter of a 2M-step heatmap's time. Buckets come in few
sizes (the rollup rows of one level, a bucket of finer rows at each end), so the segments
of each size are reduced as one block: a view where they are adjacent, else gathered
(that matrix with a bucket of other size at the start: 3 ms, against reduceat's 18 ms).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

#: More distinct segment sizes than this: one block per size no longer pays off.
MAX_SIZES = 32


def reduce_at(
    ufunc: np.ufunc, array: npt.NDArray[Any], starts: npt.NDArray[np.intp], axis: int = 0
) -> npt.NDArray[Any]:
    """`ufunc.reduceat(array, starts, axis)` for strictly increasing `starts` that begin
    at 0: segment i runs from starts[i] to starts[i + 1] (the last to the end).

    >>> reduce_at(np.maximum, np.array([[1, 5], [3, 2], [0, 9]]), np.array([0, 2]))
    array([[3, 5],
           [0, 9]])
    """
    moved = np.moveaxis(array, axis, 0)
    sizes = np.diff(starts, append=moved.shape[0])
    distinct = np.unique(sizes)
    if len(distinct) > MAX_SIZES:
        return ufunc.reduceat(array, starts, axis=axis)
    out = np.empty((len(starts), *moved.shape[1:]), dtype=array.dtype)
    for size in distinct.tolist():
        which = np.flatnonzero(sizes == size)
        first, count = int(starts[which[0]]), len(which)
        if starts[which[-1]] - first == (count - 1) * size:  # adjacent: a view, no copy
            block = moved[first : first + count * size].reshape(count, size, *moved.shape[1:])
        else:
            block = moved[starts[which, None] + np.arange(size)]
        out[which] = ufunc.reduce(block, axis=1)
    return np.moveaxis(out, 0, axis)
