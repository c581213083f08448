"""ampwatch agent: attach to a mixed-precision training loop and stream its health signals.

    from ampwatch.agent import watch
    with watch(model, optimizer, scaler, run="gpt-small") as handle:
        ...  # the unchanged torch.amp training loop

torch is imported lazily (PEP 562): the collector host imports `ampwatch.agent.wire`, which
needs only the standard library, and must not pay for (or even have) torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ampwatch.agent.attach import watch
    from ampwatch.agent.handle import Lifecycle, WatchHandle

__all__ = ["Lifecycle", "WatchHandle", "watch"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        # The module is not named `watch`: importing a submodule sets it as an attribute of
        # the package, which would shadow the `watch` function.
        from ampwatch.agent import attach

        return getattr(attach, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
