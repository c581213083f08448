"""Page URLs under the app's mount prefix (`/dashboard/` in the collector, `/` standalone).

Dash's `get_relative_path` does this untyped; these keep the pages type-checked. App paths:
`/` runs, `/run/<id>` a run, `/run/<id>/layer/<name>?step=N` one layer, `/run/<id>/fp8` its
FP8 readiness, `/compare?runs=1,2`.
"""

from __future__ import annotations

from urllib.parse import parse_qs, quote

import dash


def href(app: dash.Dash, path: str) -> str:
    """The browser URL of an app path: `href(app, "/run/3")` → `/dashboard/run/3` when mounted."""
    return f"{app.config.requests_pathname_prefix}{path.lstrip('/')}"


def page_path(app: dash.Dash, pathname: str | None) -> str:
    """The app path of a browser URL, without prefix or slashes: `/dashboard/run/3` → `run/3`."""
    return app.strip_relative_path(pathname or "/") or ""


def run_path(run_id: int) -> str:
    return f"/run/{run_id}"


def layer_path(run_id: int, layer: str) -> str:
    """A layer's page; the name is quoted whole (parameter names may hold any character).

    >>> layer_path(3, "blocks.0/attn.weight")
    '/run/3/layer/blocks.0%2Fattn.weight'
    """
    return f"/run/{run_id}/layer/{quote(layer, safe='')}"


def fp8_path(run_id: int) -> str:
    return f"/run/{run_id}/fp8"


def compare_path(run_ids: list[int]) -> str:
    return "/compare" + (f"?runs={','.join(map(str, run_ids))}" if run_ids else "")


def query_ints(search: str | None, name: str) -> list[int]:
    """Integers of a comma-separated query parameter, ignoring anything else.

    >>> query_ints("?runs=3,x,5&step=2", "runs"), query_ints(None, "step")
    ([3, 5], [])
    """
    values = parse_qs((search or "").lstrip("?")).get(name, [])
    return [int(v) for value in values for v in value.split(",") if v.strip().isdigit()]
