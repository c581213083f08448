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
    from ampwatch.agent.policy import EXIT_CRITICAL_ALERT, CriticalAlert, FiringAlert
    from ampwatch.agent.resume import ResumeFrom, load_resume_plan

__all__ = [
    "EXIT_CRITICAL_ALERT",
    "CriticalAlert",
    "FiringAlert",
    "Lifecycle",
    "ResumeFrom",
    "WatchHandle",
    "load_resume_plan",
    "watch",
]
#: The stdlib-only names (alert policy, resume plans): importable without torch.
_LIGHT = {
    "EXIT_CRITICAL_ALERT": "policy",
    "CriticalAlert": "policy",
    "FiringAlert": "policy",
    "ResumeFrom": "resume",
    "load_resume_plan": "resume",
}


def __getattr__(name: str) -> Any:
    if name in _LIGHT:
        import importlib

        return getattr(importlib.import_module(f"ampwatch.agent.{_LIGHT[name]}"), name)
    if name in __all__:
        # The module is not named `watch`: importing a submodule sets it as an attribute of
        # the package, which would shadow the `watch` function.
        from ampwatch.agent import attach

        return getattr(attach, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
