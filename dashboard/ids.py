"""Component ids, defined once so a layout and the callbacks that target it cannot drift."""

from __future__ import annotations

from typing import Final

# App shell (router).
URL: Final = "url"
PAGE: Final = "page"
#: The URL (path + query) of the page the initial layout came with; None once checked.
PAGE_DRAWN: Final = "page-drawn"
#: {pathname, search} of a page the router must draw.
ROUTE: Final = "route"

# Runs list page.
RUNS_REFRESH: Final = "runs-refresh"
RUNS_DATA: Final = "runs-data"
RUNS_TABLE: Final = "runs-table"
RUNS_FILTER_TEXT: Final = "runs-filter-text"
RUNS_FILTER_HEALTH: Final = "runs-filter-health"
RUNS_FILTER_STATUS: Final = "runs-filter-status"
RUNS_SORT: Final = "runs-sort"
#: Pattern-matching id type of the sortable column headers: {"type": ..., "column": key}.
RUNS_SORT_HEADER: Final = "runs-sort-header"

# Run page.
RUN_ID: Final = "run-id"
RUN_REFRESH: Final = "run-refresh"
RUN_DATA: Final = "run-data"
RUN_CURSOR: Final = "run-cursor"
RUN_ZOOM: Final = "run-zoom"
RUN_HEADER: Final = "run-header"
RUN_GRAPHS: Final = "run-graphs"
RUN_LAYER_PICK: Final = "run-layer-pick"
LOSS_SCALE_GRAPH: Final = "loss-scale-graph"
SKIP_RATE_GRAPH: Final = "skip-rate-graph"
GRAD_NORM_GRAPH: Final = "grad-norm-graph"
ACTIVATION_NORM_GRAPH: Final = "activation-norm-graph"
HEATMAP_STAT: Final = "heatmap-stat"
HEATMAP_GRAPH: Final = "heatmap-graph"
ALERTS_GRAPH: Final = "alerts-graph"
ALERTS_LIST: Final = "alerts-list"
CHECKPOINTS_TABLE: Final = "checkpoints-table"
#: The step charts whose zoom (relayoutData) refetches finer data from the collector.
ZOOMABLE_GRAPHS: Final = (
    LOSS_SCALE_GRAPH,
    SKIP_RATE_GRAPH,
    GRAD_NORM_GRAPH,
    ACTIVATION_NORM_GRAPH,
    HEATMAP_GRAPH,
)

# Layer drill-down page.
LAYER_KEY: Final = "layer-key"
LAYER_HEADER: Final = "layer-header"
LAYER_PICK: Final = "layer-pick"
LAYER_SERIES_GRAPH: Final = "layer-series-graph"
LAYER_HISTOGRAM_GRAPH: Final = "layer-histogram-graph"

# FP8 readiness page.
FP8_RUN_ID: Final = "fp8-run-id"
FP8_BODY: Final = "fp8-body"
FP8_MATRIX_GRAPH: Final = "fp8-matrix-graph"
FP8_TREND_RECIPE: Final = "fp8-trend-recipe"
FP8_TREND_GRAPH: Final = "fp8-trend-graph"
FP8_LOSS_SCALE_ADVICE: Final = "fp8-loss-scale-advice"

# Compare page.
COMPARE_PICK: Final = "compare-pick"
COMPARE_GRAPH: Final = "compare-graph"
