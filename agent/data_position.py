"""Which batches each optimizer step consumed: `handle.data_position(batch, epoch=...)`.

So that a resume plan can say "skip batches 412-431 of epoch 0" rather than only "skip
steps 103-107" (`ampwatch.server.resume_plan`), the loop reports the index of the batch a
step starts with (`batch_idx`, as Lightning Fabric's `skip_batches.json` lists it). Sent
sparsely: a `data_position` event when the position stops following its stride (the
first step, the step after, a new epoch, a resumed or skipping loader), none while
`batch = first + stride * (step - first_step)` holds; the collector extends the stride.
"""

from __future__ import annotations

from typing import Any


class DataPositions:
    """The training thread's side: `note` a step's position, get the event to send, if any."""

    def __init__(self) -> None:
        self._anchor: tuple[int, int, int] | None = None  # (step, epoch, batch)
        self._stride: int | None = None
        self._last_step: int | None = None

    def note(self, step: int, epoch: int, batch: int) -> tuple[int, dict[str, Any]] | None:
        """The event (its step, its data) that step `step`'s first batch `batch` of `epoch`
        calls for, or None when the collector can infer it (or the step already has a
        position: a later micro-batch of it). Raises ValueError for a negative or non-int."""
        for name, value in (("batch", batch), ("epoch", epoch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"data_position: {name} must be an int >= 0, got {value!r}")
        if step == self._last_step:
            return None
        self._last_step = step
        anchor = self._anchor
        if anchor is not None and anchor[1] == epoch and step > anchor[0]:
            steps, moved = step - anchor[0], batch - anchor[2]
            if self._stride is None and moved > 0 and moved % steps == 0:
                self._stride = moved // steps  # the anchor again, now with its stride
                return anchor[0], {"epoch": epoch, "batch": anchor[2], "stride": self._stride}
            if self._stride is not None and moved == self._stride * steps:
                return None
        self._anchor, self._stride = (step, epoch, batch), None
        return step, {"epoch": epoch, "batch": batch, "stride": None}
