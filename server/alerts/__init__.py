"""The alert engine: rules evaluated incrementally as batches arrive, plus a time sweep.

- `evaluate_batch(session, run, batch, now=...)`: called by ingest inside its transaction.
- `sweep(session, now)`: the `no_data` rule, called periodically by a background worker.
- `RULES`: every rule's severity, scope, description and settings model.
- `effective_settings`, `validate_overrides`, `load_file`: thresholds and their precedence
  (run > project > the `alerts_file` > defaults).

How state and evaluation work, and why: ARCHITECTURE.md, "Alerts".
"""

from __future__ import annotations

from ampwatch.server.alerts.config import (
    AlertConfigError,
    FileRules,
    effective_settings,
    load_file,
    validate_overrides,
)
from ampwatch.server.alerts.evaluate import evaluate_batch
from ampwatch.server.alerts.rule_settings import RuleSettings
from ampwatch.server.alerts.rules import RULES, Rule
from ampwatch.server.alerts.sweep import sweep

__all__ = [
    "RULES",
    "AlertConfigError",
    "FileRules",
    "Rule",
    "RuleSettings",
    "effective_settings",
    "evaluate_batch",
    "load_file",
    "sweep",
    "validate_overrides",
]
