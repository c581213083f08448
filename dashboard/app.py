"""Builds the Dash app: a shell with a `dcc.Location` router over the pages in `pages/`.

Why not Dash's `use_pages`: `dash.register_page` writes to one process-wide registry
(`dash.page_registry`), so two apps in one process (the tests make many; a collector could
serve two mounts) would share and clobber pages. Here each page module exposes
`layout(**kwargs)` and `register_callbacks(app, client)`, and every callback is registered
on its own app instance with `app.callback`, never on the global `dash.callback` list.

    >>> app = create_dash_app("http://127.0.0.1:8000", requests_pathname_prefix="/dashboard/")
    >>> app.config.requests_pathname_prefix
    '/dashboard/'
"""

from __future__ import annotations

import re
from typing import Any

import dash
import httpx
from dash import Input, Output, dcc, html

from ampwatch.dashboard import ids
from ampwatch.dashboard.client import CollectorClient
from ampwatch.dashboard.pages import run, runs
from ampwatch.dashboard.urls import href, page_path

RUN_PATH = re.compile(r"^run/(\d+)$")

# Inline, so the package ships no assets folder that an install could forget.
INDEX_STRING = """<!DOCTYPE html>
<html>
<head>
{%metas%}<title>{%title%}</title>{%favicon%}{%css%}
<style>
body { font-family: system-ui, sans-serif; margin: 0; color: #222; background: #fafafa; }
.topbar { background: #1f2937; padding: 10px 24px; }
.topbar a { color: #fff; font-weight: 600; text-decoration: none; }
.content { padding: 8px 24px 24px; max-width: 1400px; }
table.runs { border-collapse: collapse; width: 100%; background: #fff; }
table.runs th, table.runs td { padding: 6px 12px; border-bottom: 1px solid #e5e7eb;
  text-align: left; }
table.runs th { background: #f3f4f6; font-weight: 600; }
table.runs td.num { text-align: right; font-variant-numeric: tabular-nums; }
.status-running { color: #15803d; }
.status-ended { color: #6b7280; }
dl.facts { display: flex; flex-wrap: wrap; gap: 4px 24px; margin: 0 0 8px; }
dl.facts dt { color: #6b7280; font-size: 0.85em; }
dl.facts dd { margin: 0 0 0 6px; font-weight: 600; }
.error { color: #b91c1c; }
</style>
</head>
<body>
{%app_entry%}
<footer>{%config%}{%scripts%}{%renderer%}</footer>
</body>
</html>"""


def create_dash_app(
    api_url: str,
    *,
    requests_pathname_prefix: str = "/",
    transport: httpx.BaseTransport | None = None,
    token: str | None = None,
) -> dash.Dash:
    """A dashboard reading from the collector at `api_url`.

    Mounted under a prefix (the collector mounts it at `/dashboard` through a2wsgi, which
    passes the prefix as SCRIPT_NAME), give that prefix as `requests_pathname_prefix`:
    the browser needs it in every URL, while Flask's routes stay at `/`.
    `transport` is for tests (`httpx.MockTransport`); `token` is sent as a bearer token
    to a collector that requires one.
    """
    client = CollectorClient(api_url, transport=transport, token=token)
    app = dash.Dash(
        __name__,
        requests_pathname_prefix=requests_pathname_prefix,
        routes_pathname_prefix="/",
        title="ampwatch",
        update_title="",  # keep the tab title steady while the page refreshes
        index_string=INDEX_STRING,
    )
    shell = html.Div(
        [
            dcc.Location(id=ids.URL),
            html.Nav(dcc.Link("ampwatch", href=href(app, "/")), className="topbar"),
            html.Main(id=ids.PAGE, className="content"),
        ]
    )
    app.layout = shell
    # Callbacks target ids that exist only once their page is shown; the validation
    # layout lists every page so Dash still checks each id instead of suppressing errors.
    # (Dash annotates `validation_layout` as None, though it documents a component.)
    app.validation_layout = html.Div([shell, runs.layout(), run.layout()])  # type: ignore[assignment]

    @app.callback(Output(ids.PAGE, "children"), Input(ids.URL, "pathname"))
    def route(pathname: str | None) -> Any:
        path = page_path(app, pathname)
        if path == "":
            return runs.layout()
        if match := RUN_PATH.match(path):
            return run.layout(run_id=int(match.group(1)))
        return html.Div(
            [
                html.H2("Page not found"),
                html.P(f"There is no dashboard page at {pathname}."),
                dcc.Link("All runs", href=href(app, "/")),
            ]
        )

    runs.register_callbacks(app, client)
    run.register_callbacks(app, client)
    return app
