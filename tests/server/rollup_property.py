"""What the rollup property tests (layer and step rollups against the raw rows) share."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

#: The rollup properties' hypothesis settings: each example ingests into the function's
#: database (a fresh run id per example keeps them apart), and a slow example is the
#: database's time, not a test to shrink.
ROLLUP_PROPERTY = settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
