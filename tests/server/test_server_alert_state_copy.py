"""The rule states' JSON copies (`alerts.json_copy`): on states the engine itself stored
after a calibration, skips, a spike and a NaN, the copy is the JSON that `deepcopy` and
`dataclasses.asdict` made before it, shares no container with its source, and a state
loads from it and saves back to the same JSON."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from alert_feed import Feed, calibration, healthy
from wire_batches import step_record

from ampwatch.server.alerts.json_copy import json_copy
from ampwatch.server.alerts.precursors import PrecursorState
from ampwatch.server.alerts.state import StepState


def _containers(value: Any) -> list[Any]:
    """Every dict and list inside `value` (itself included)."""
    found: list[Any] = []
    if isinstance(value, (dict, list)):
        found.append(value)
        for item in value.values() if isinstance(value, dict) else value:
            found.extend(_containers(item))
    return found


def _fed(feed: Feed) -> dict[str, dict[str, Any]]:
    feed.send_steps([*calibration(), *healthy(5, 300, skips={50: 2048.0, 51: 1024.0})])
    feed.send([step_record(305, loss=9.0, loss_scale=1024.0),
               step_record(306, loss=float("nan"), loss_scale=512.0, skipped=True),
               *healthy(307, 20, scale=512.0)])  # fmt: skip
    return {key: feed.state(key) for key in ("steps", "precursors")}


def test_a_stored_state_copies_as_deepcopy_and_asdict_did(feed: Feed) -> None:
    stored = _fed(feed)
    steps = StepState.from_json(stored["steps"])
    assert steps.changes and steps.recent.losses and steps.recent.window  # a full state
    early = PrecursorState.from_json(stored["precursors"])

    for state, data in ((steps, stored["steps"]), (early, stored["precursors"])):
        copied = json_copy(state)
        assert copied == copy.deepcopy(dataclasses.asdict(state))
        assert copied == data  # what the engine stored, saved back unchanged
        assert type(state).from_json(copied) == state
        inside = {id(c) for c in _containers(copied)}
        assert not inside & {id(c) for c in _containers(dataclasses.asdict(state))}
        assert not inside & {id(c) for c in _containers(data)}


def test_a_loaded_state_shares_nothing_with_the_row_it_came_from(feed: Feed) -> None:
    data = _fed(feed)["steps"]
    before = copy.deepcopy(data)
    state = StepState.from_json(data)
    state.changes.append([999, 1.0])
    state.recent.window.append([999, 1.0, False])
    state.clear["x"] = 1
    assert data == before  # the ORM's value is untouched: the save is seen as a change


def test_tuples_become_lists_and_leaves_are_shared() -> None:
    leaf = "a string"
    assert json_copy({"a": (1, [2.0, None], leaf)}) == {"a": [1, [2.0, None], leaf]}
    assert json_copy([leaf])[0] is leaf
