"""Replacing one method on one object (a scaler, an accelerator, a DeepSpeed engine) and
putting it back exactly: the class and every other instance stay untouched, and an
attribute the instance itself held before is restored, not deleted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MISSING = object()


def patch_method(
    obj: Any, name: str, make: Callable[[Callable[..., Any]], Any]
) -> Callable[[], None]:
    """Set `obj.name = make(original bound method)`; return the function that restores it.

    >>> class Engine:
    ...     def step(self): return "real"
    >>> engine = Engine()
    >>> restore = patch_method(engine, "step", lambda real: lambda: "patched " + real())
    >>> engine.step(), restore(), engine.step()
    ('patched real', None, 'real')
    """
    saved = obj.__dict__.get(name, _MISSING)
    setattr(obj, name, make(getattr(obj, name)))

    def restore() -> None:
        if saved is _MISSING:
            obj.__dict__.pop(name, None)
        else:
            setattr(obj, name, saved)

    return restore
