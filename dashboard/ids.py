"""Component ids, defined once so a layout and the callbacks that target it cannot drift."""

from __future__ import annotations

from typing import Final

# App shell (router).
URL: Final = "url"
PAGE: Final = "page"

# Runs list page.
RUNS_REFRESH: Final = "runs-refresh"
RUNS_TABLE: Final = "runs-table"

# Run page.
RUN_ID: Final = "run-id"
RUN_REFRESH: Final = "run-refresh"
RUN_DATA: Final = "run-data"
RUN_HEADER: Final = "run-header"
RUN_GRAPHS: Final = "run-graphs"
LOSS_SCALE_GRAPH: Final = "loss-scale-graph"
ACTIVATION_NORM_GRAPH: Final = "activation-norm-graph"
ZERO_FRACTION_GRAPH: Final = "zero-fraction-graph"
