"""A copy of a rule state as the JSON it is stored as: what `copy.deepcopy` and
`dataclasses.asdict` did, at a fraction of the cost.

Why: every batch loads each of its run's rule states from their JSON rows and saves them
back, and the states hold a few hundred numbers (the spike windows, the scale's change
points). `deepcopy` (which `asdict` calls on every leaf) keeps a memo of every object it
visits and was ~10% of a batch's CPU in profiles of `bench/load.py`'s batches. A stored
state is a tree of dicts, lists and immutable leaves (numbers, strings, None), so copying
the containers and sharing the leaves is a full copy.

>>> from dataclasses import dataclass, field
>>> @dataclass
... class S:
...     window: list[list[float]] = field(default_factory=lambda: [[1, 2.0]])
>>> s = S()
>>> copied = json_copy(s)
>>> copied, copied["window"][0] is s.window[0]
({'window': [[1, 2.0]]}, False)
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: The immutable leaves of a stored state, answered first: most of a state's values.
_LEAVES = frozenset({float, int, str, bool, type(None)})


def json_copy(value: Any) -> Any:
    """`value` with every dict, list and tuple copied (a tuple as a list, as JSON stores
    it) and every dataclass as a dict of its fields; other values are shared."""
    if type(value) in _LEAVES:
        return value
    if isinstance(value, (list, tuple)):
        return [json_copy(item) for item in value]
    if isinstance(value, dict):
        return {key: json_copy(item) for key, item in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: json_copy(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value
