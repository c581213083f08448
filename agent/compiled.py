"""`torch.compile`: what the agent's model hooks must do so that a compiled model keeps one
graph, and how `watch()` gets its hooks into code that was compiled before it.

Dynamo traces a module's forward hooks into its graph and guards on what they read, and
on the length of every hook dict that was not empty when it compiled. So:
- a hook that reads Python state changing per micro-batch recompiles per micro-batch
  (`hooks.ActivationNorm` keeps its state in device tensors for this reason);
- a hook added or removed between steps recompiles at that step: the hooks the agent adds
  only for sampled steps (per-leaf activation max-abs, FP8 activation statistics) are not
  added for a compiled model, and their bodies, like the precision probe's, do nothing
  while traced (`tracing()`), so a model compiled after `watch()` pays one recompile, at
  the first step, when they are removed, and none after;
- a hook added to a module whose hook dict was empty when it compiled is not seen at all
  (dynamo skips that guard, `torch._dynamo.config.skip_nnmodule_hook_guards`): `watch()`
  on a model already compiled and run clears dynamo's caches (`torch.compiler.reset()`),
  so the next call compiles once more, with the hooks. Every other compiled function in
  the process recompiles once too; nothing else changes.

Measured (bench/compile_overhead.py, aot_eager, 4 and 8 micro-batches per step): the graph
count with the agent equals the count without it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger("ampwatch.agent")


def tracing() -> bool:
    """True while dynamo traces: a hook that must not add ops or guards returns at once
    (the test is a constant to dynamo, never a guard)."""
    return torch.compiler.is_compiling()


def is_compiled(model: object) -> bool:
    """Whether `model` is a `torch.compile` wrapper (`OptimizedModule`) or a module
    compiled in place (`module.compile()`)."""
    return isinstance(model, nn.Module) and (
        isinstance(getattr(model, "_orig_mod", None), nn.Module)
        or getattr(model, "_compiled_call_impl", None) is not None
    )


def has_compiled_code(passed: object, model: nn.Module) -> bool:
    """Whether dynamo already holds compiled code that ran `model` (so hooks added now
    would not run): a cache entry for the forward of one of its modules, or, for a
    compile wrapper, any frame dynamo compiled in this process (its root hooks trace
    through a shared wrapper frame)."""
    try:
        from torch._dynamo.convert_frame import input_codes
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        codes = {
            code
            for module in model.modules()
            if (code := getattr(type(module).forward, "__code__", None)) is not None
        }
        if any(_debug_get_cache_entry_list(code) for code in codes):
            return True
        return is_compiled(passed) and bool(input_codes.seen)
    except Exception:  # noqa: BLE001 - dynamo internals moved: assume compiled if wrapped
        return is_compiled(passed)


def forget_compiled_code(passed: object, model: nn.Module) -> bool:
    """Clear dynamo's caches when `model` already ran compiled, so that the hooks `watch()`
    adds are traced at the next call (one recompile); True if it did."""
    if not has_compiled_code(passed, model):
        return False
    torch.compiler.reset()
    logger.info(
        "ampwatch: the model already ran under torch.compile; dynamo's caches were cleared "
        "so that the agent's hooks run (it recompiles once)"
    )
    return True


def say_sampled_hooks_off() -> None:
    """The one log line for what a compiled model is not measured on."""
    logger.info(
        "ampwatch: the model runs under torch.compile; per-leaf activation max-abs and FP8 "
        "activation statistics are off (hooks added for sampled steps would recompile "
        "the graph); gradient, weight and activation-norm statistics are measured"
    )
