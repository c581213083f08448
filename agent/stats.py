"""Device-side reductions over gradients, and the host-side arithmetic that finishes them.

The training thread only launches reductions; the sender thread turns the copied counts into
fractions, so no statistic costs a host sync where it is measured.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class RunningMean:
    """Mean of device scalars across micro-batches, kept as one device sum (bounded memory).

    >>> m = RunningMean(); m.add(torch.tensor(1.0)); m.add(torch.tensor(3.0)); m.take()
    tensor(2.)
    """

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self._count = 0

    def add(self, value: torch.Tensor) -> None:
        value = value.to(torch.float32)
        self._sum = value if self._sum is None else self._sum + value
        self._count += 1

    def take(self) -> torch.Tensor | None:
        """Return the mean since the last take (None if nothing was added) and reset."""
        if self._sum is None:
            return None
        mean = self._sum if self._count == 1 else self._sum / self._count
        self._sum, self._count = None, 0
        return mean


def nonzero_counts(
    named_params: Iterable[tuple[str, torch.nn.Parameter]],
) -> tuple[list[str], list[int], torch.Tensor] | None:
    """Count the non-zero gradient elements of every parameter that has a gradient.

    Returns (names, element counts, int64 device tensor of non-zero counts), or None when no
    parameter has a gradient. Parameters whose `.grad` is None are skipped (not reported as
    NaN): a frozen or unused parameter is not an underflowing one.

    `count_nonzero` is exact in int64; `torch._foreach_norm(grads, ord=0)` would be one call
    but accumulates in float and stops counting at 2**25 elements on CPU, so it is wrong
    for large embedding tables.
    """
    names: list[str] = []
    numels: list[int] = []
    counts: list[torch.Tensor] = []
    device: torch.device | None = None
    for name, param in named_params:
        grad = param.grad
        if grad is None:
            continue
        if device is None:
            device = grad.device
        names.append(name)
        numels.append(grad.numel())
        counts.append(torch.count_nonzero(grad).to(device, non_blocking=True))
    if not counts:
        return None
    return names, numels, torch.stack(counts)


def zero_fractions(numels: list[int], nonzero: list[int]) -> list[float]:
    """Host side: the fraction of each tensor's gradient elements that are exactly zero.

    >>> zero_fractions([4, 2], [1, 2])
    [0.75, 0.0]
    """
    return [(n - nz) / n if n else 0.0 for n, nz in zip(numels, nonzero, strict=True)]
