"""The Prometheus text exposition format (version 0.0.4), written by hand: label
escaping, sample values, a family's lines. `metrics` and `run_metrics` write through it.

A scrape with 1,000 runs writes ~11,000 samples, so labels are rendered to text once
per run (`render_labels`) and reused by every family of the run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def escape(value: str) -> str:
    """A label value as the text format quotes it (backslash, double quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_labels(labels: dict[str, str]) -> str:
    """The inside of `{...}`: `key="value"` pairs, escaped; empty for no labels.

    >>> render_labels({"project": "nlp", "run": 'a "b"'})
    'project="nlp",run="a \\\\"b\\\\""'
    """
    return ",".join(f'{key}="{escape(value)}"' for key, value in labels.items())


def format_value(value: float) -> str:
    """A sample value: `NaN`, `+Inf`, `-Inf`, an int as written, else Python's shortest
    round-tripping float (Python's own 'nan' and 'inf' are not the format's spelling)."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def family(name: str, kind: str, help_text: str, samples: Iterable[tuple[str, float]]) -> list[str]:
    """A family's lines: HELP, TYPE, then each (labels as `render_labels` wrote them, value).

    >>> family("ampwatch_runs", "gauge", "Runs.", [('project="nlp"', 2)])
    ['# HELP ampwatch_runs Runs.', '# TYPE ampwatch_runs gauge', 'ampwatch_runs{project="nlp"} 2']
    """
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for text, value in samples:
        number = format_value(value)
        lines.append(f"{name}{{{text}}} {number}" if text else f"{name} {number}")
    return lines
