"""Page URLs under the app's mount prefix (`/dashboard/` in the collector, `/` standalone).

Dash's `get_relative_path` does this untyped; these two keep the pages type-checked.
"""

from __future__ import annotations

import dash


def href(app: dash.Dash, path: str) -> str:
    """The browser URL of an app path: `href(app, "/run/3")` → `/dashboard/run/3` when mounted."""
    return f"{app.config.requests_pathname_prefix}{path.lstrip('/')}"


def page_path(app: dash.Dash, pathname: str | None) -> str:
    """The app path of a browser URL, without prefix or slashes: `/dashboard/run/3` → `run/3`."""
    return app.strip_relative_path(pathname or "/") or ""
