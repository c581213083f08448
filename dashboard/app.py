"""Builds the Dash app: a shell with a `dcc.Location` router over the pages in `pages/`.

Pages: `/` runs overview, `/run/<id>` a run, `/run/<id>/layer/<name>` one layer,
`/compare?runs=1,2` runs overlaid. A visit by URL (a bookmark, an alert's link) gets its
page inside the initial layout; in-app navigation goes through the router callback.

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

import gzip
import logging
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import dash
import flask
import httpx
from dash import Input, Output, State, dcc, html

from ampwatch.dashboard import generator_runtime, ids, plotly_bundle
from ampwatch.dashboard.client import CollectorClient
from ampwatch.dashboard.pages import compare, fp8, layer, run, run_store, runs
from ampwatch.dashboard.prefetch import Prefetcher
from ampwatch.dashboard.urls import compare_path, fp8_path, href, page_path, query_ints, run_path

log = logging.getLogger(__name__)

RUN_PATH = re.compile(r"^run/(\d+)$")
LAYER_PATH = re.compile(r"^run/(\d+)/layer/(.+)$")
FP8_PATH = re.compile(r"^run/(\d+)/fp8$")
PAGES = (runs, run, layer, compare, fp8)
#: Served with a year's cache: the name carries the version.
BUNDLE_ROUTE = f"_ampwatch/plotly-cartesian-{plotly_bundle.VERSION}.min.js"
# Loads plotly.js right after the Dash renderer has started (its layout request is out), so
# the download and V8's off-thread compile overlap the server's work on the page; earlier,
# at page start, it competed with Dash's own scripts. While it loads, `window.Plotly` is a
# promise: dcc.Graph waits on whatever `window.Plotly` holds (`Promise.resolve(
# window.Plotly || <load it>)`), and the bundle replaces the promise with itself when it runs.
PLOTLY_LOADER = """<script>
function ampwatchLoadPlotly() {
  if (window.Plotly) return;
  window.Plotly = new Promise(function (resolve, reject) {
    var script = document.createElement("script");
    script.src = "%s";
    script.onload = resolve;
    script.onerror = reject;
    document.head.appendChild(script);
  });
}
</script>
"""

# Dash's @babel/polyfill (core-js 2; served only where `generator_runtime.RUNTIME` does not
# suffice for Dash's scripts) judges these natives of every current browser broken -- its whitespace list still holds
# U+180E, which Unicode 6.3 dropped -- and replaces them with JavaScript versions, which
# plotly.js then calls tens of thousands of times while it draws (60 ms of a cold run page's
# main thread, profiled). The natives are saved before Dash's scripts and put back after
# them, before the renderer starts: they are the standard's behaviour.
NATIVES = """<script>
var ampwatchNatives = [[window, "parseFloat"], [window, "parseInt"], [Number, "parseFloat"],
  [Number, "parseInt"], [String.prototype, "trim"], [String.prototype, "trimStart"],
  [String.prototype, "trimEnd"], [String.prototype, "trimLeft"], [String.prototype, "trimRight"]
].map(function (p) { return [p[0], p[1], p[0][p[1]]]; });
function ampwatchRestoreNatives() {
  ampwatchNatives.forEach(function (p) {
    if (typeof p[2] === "function" && p[0][p[1]] !== p[2]) {
      Object.defineProperty(p[0], p[1], {value: p[2], writable: true, configurable: true});
    }
  });
}
</script>
"""

#: dcc's lazily loaded chunks that every page draws with, loaded with Dash's scripts: left
#: to dcc, each is fetched and run only once React has drawn the layout's first Graph or
#: Dropdown, a round trip and a script between the layout's arrival and the charts. They
#: are webpack chunks that register themselves, so dcc finds them loaded.
EAGER_CHUNKS = ("async-graph.js", "async-dropdown.js")

# In the browser, on every URL change (the Location's mount included): route, unless this
# is the page the initial layout already holds (checked once, then forgotten, so coming
# back to that URL later routes as any other).
ROUTE_GUARD = """function (pathname, search, drawn) {
    const here = (pathname || "") + (search || "");
    const route = drawn === here ? window.dash_clientside.no_update
        : {pathname: pathname, search: search};
    return [route, null];
}"""

# Inline, so the package ships no assets folder that an install could forget.
INDEX_STRING = """<!DOCTYPE html>
<html>
<head>
{%metas%}<title>{%title%}</title>{%favicon%}{%css%}
<style>
body { font-family: system-ui, sans-serif; margin: 0; color: #222; background: #fafafa; }
.topbar { background: #1f2937; padding: 10px 24px; }
.topbar a { color: #fff; font-weight: 600; text-decoration: none; margin-right: 24px; }
.topbar a.nav { font-weight: 400; }
.content { padding: 8px 24px 24px; max-width: 1400px; box-sizing: border-box; }
table.runs { border-collapse: collapse; width: 100%; background: #fff; }
table.runs th, table.runs td { padding: 6px 12px; border-bottom: 1px solid #e5e7eb;
  text-align: left; }
table.runs th { background: #f3f4f6; font-weight: 600; }
table.runs td.num { text-align: right; font-variant-numeric: tabular-nums; }
.status-running { color: #15803d; }
.status-ended { color: #6b7280; }
dl.facts { display: flex; flex-wrap: wrap; gap: 4px 24px; margin: 0 0 8px; }
dl.facts > div { display: flex; align-items: baseline; }
dl.facts dt { color: #6b7280; font-size: 0.85em; }
dl.facts dd { margin: 0 0 0 6px; font-weight: 600; }
.error { color: #b91c1c; }
.muted { color: #6b7280; }
.title-row { display: flex; align-items: center; gap: 16px; }
.title-row .aside { margin-left: auto; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 0.8em;
  font-weight: 600; margin-right: 6px; background: #e5e7eb; color: #374151; }
.badge.health-ok { background: #dcfce7; color: #166534; }
.badge.health-warning { background: #ffedd5; color: #9a3412; }
.badge.health-critical { background: #fee2e2; color: #991b1b; }
.badge.status-firing { background: #991b1b; color: #fff; }
.filters { display: flex; gap: 12px; margin: 8px 0 12px; align-items: center; }
.filters input[type="search"] { padding: 6px 8px; width: 280px; border: 1px solid #d1d5db;
  border-radius: 4px; }
.filters .dash-dropdown { width: 180px; }
button.sort { background: none; border: none; font: inherit; font-weight: 600;
  cursor: pointer; padding: 0; color: inherit; }
.pair { display: grid; grid-template-columns: 1fr 1fr; gap: 8px; }
.controls { display: flex; gap: 24px; align-items: center; margin: 12px 0 0; }
.controls .dash-dropdown { width: 420px; }
ul.alerts { list-style: none; padding: 0; }
li.alert { background: #fff; border-left: 4px solid #d1d5db; padding: 6px 12px;
  margin-bottom: 6px; }
li.alert-firing { border-left-color: #d62728; }
li.alert .message { margin-top: 2px; }
li.alert .values { font-size: 0.85em; font-family: ui-monospace, monospace; }
tr.candidate-recommended { background: #dcfce7; font-weight: 600; }
tr.candidate-rejected { color: #6b7280; }
.verdict-recommended { color: #166534; }
.recommend { font-weight: 600; color: #166534; }
.crumbs { margin-top: 12px; }
</style>
</head>
<body>
{%app_entry%}
<footer>{%config%}{%scripts%}<script>ampwatchRestoreNatives()</script>{%renderer%}<script>ampwatchLoadPlotly()</script></footer>
</body>
</html>"""


def index_string(prefix: str, bundled: bool) -> str:
    """The page's HTML under mount `prefix`: the natives saved before Dash's scripts
    (`NATIVES`), dcc's eager chunks before the renderer (`EAGER_CHUNKS`), plotly.js loaded
    after it (`PLOTLY_LOADER`): the cartesian bundle when there is one (`bundled`), else
    the full plotly.js that Dash ships."""
    plotly_url = prefix + (
        BUNDLE_ROUTE if bundled else "_dash-component-suites/plotly/package_data/plotly.min.js"
    )
    chunks = "".join(
        f'<script src="{prefix}_dash-component-suites/dash/dcc/{name}"></script>'
        for name in EAGER_CHUNKS
    )
    return (
        INDEX_STRING.replace("<head>", "<head>\n" + NATIVES, 1)
        .replace("</head>", PLOTLY_LOADER % plotly_url + "</head>")
        .replace("{%renderer%}", chunks + "{%renderer%}")
    )


def add_server_hooks(
    app: dash.Dash, prefetcher: Prefetcher[int, dict[str, Any]], bundle: Path | None
) -> None:
    """On the app's Flask server: a run page's data read while its HTML's scripts load
    (`prefetch`; the page's layout takes it), `_dash-layout` kept out of caches, and the
    cartesian plotly.js `bundle` served (when there is one)."""

    def prefetch() -> None:
        # Flask's request.path is the path below the mount's prefix.
        if flask.request.method == "GET" and (
            match := RUN_PATH.match(flask.request.path.lstrip("/"))
        ):
            prefetcher.start(int(match.group(1)))

    app.server.before_request(prefetch)

    def layout_is_per_page(response: flask.Response) -> flask.Response:
        # `_dash-layout` depends on its Referer (`initial_layout`) and holds live data:
        # no cache may keep one page's answer for another, or an old one.
        if flask.request.path == "/_dash-layout":
            response.headers["Vary"] = "Referer"
            response.headers["Cache-Control"] = "no-store"
        return response

    app.server.after_request(layout_is_per_page)

    if bundle:
        app.server.add_url_rule(f"/{BUNDLE_ROUTE}", "plotly_bundle", BundleResponder(bundle))


class BundleResponder:
    """Serves the plotly.js `bundle` from memory, gzipped once at start (at level 9)
    instead of by the collector's GZipMiddleware on every cold visit (which passes a
    response that has its Content-Encoding): 1.5 MB at level 1 cost each visit ~15 ms of
    the server's CPU, on the cores the browser shares on a workstation."""

    def __init__(self, bundle: Path) -> None:
        self.script = bundle.read_bytes()
        self.gzipped = gzip.compress(self.script, compresslevel=9, mtime=0)

    def __call__(self) -> flask.Response:
        accepts_gzip = "gzip" in flask.request.headers.get("Accept-Encoding", "")
        response = flask.Response(
            self.gzipped if accepts_gzip else self.script, mimetype="text/javascript"
        )
        if accepts_gzip:
            response.headers["Content-Encoding"] = "gzip"
        response.headers["Vary"] = "Accept-Encoding"
        response.cache_control.max_age = 31_536_000  # the name carries the version
        response.cache_control.public = True
        return response


#: dash_table's loader script, which Dash serves to every page because `import dash`
#: registers the library; no page here draws a DataTable (33.5 KB a cold visit saved).
_DASH_TABLE_TAG = re.compile(r'<script src="[^"]*/dash_table/bundle[^"]*"></script>\s*')


class _Dash(dash.Dash):
    """Dash, serving its scripts without @babel/polyfill where `generator_runtime`
    suffices for them, and without dash_table's, which no page uses."""

    # Dash calls it with keywords only; its own signature is untyped.
    def interpolate_index(self, **kwargs: Any) -> str:  # type: ignore[override]
        scripts = _DASH_TABLE_TAG.sub("", kwargs.get("scripts", ""))
        kwargs["scripts"] = generator_runtime.lighter_scripts(scripts)
        return str(super().interpolate_index(**kwargs))  # type: ignore[no-untyped-call]


class Router:
    """Which page a browser URL shows, and the app's frame around it: for the initial
    layout (`initial_layout`) and for the router callback (`page_at`)."""

    def __init__(
        self,
        app: dash.Dash,
        client: CollectorClient,
        prefetcher: Prefetcher[int, dict[str, Any]],
    ) -> None:
        self.app = app
        self.client = client
        self.prefetcher = prefetcher

    def page_at(self, pathname: str | None, search: str | None) -> Any:
        """The page at browser path `pathname` with query `search`."""
        app, client = self.app, self.client
        path = page_path(app, pathname)
        if path == "":
            return runs.layout()
        if match := RUN_PATH.match(path):
            run_id = int(match.group(1))
            return run.layout(
                run_id=run_id,
                client=client,
                data=self.prefetcher.take(run_id),
                fp8_href=href(app, fp8_path(run_id)),
            )
        if match := FP8_PATH.match(path):
            run_id = int(match.group(1))
            return fp8.layout(run_id=run_id, client=client, back=href(app, run_path(run_id)))
        if match := LAYER_PATH.match(path):
            steps = query_ints(search, "step")
            return layer.layout(
                run_id=int(match.group(1)),
                layer=unquote(match.group(2)),
                step=steps[0] if steps else None,
            )
        if path == "compare":
            return compare.layout(run_ids=query_ints(search, "runs"), client=client)
        return html.Div(
            [
                html.H2("Page not found"),
                html.P(f"There is no dashboard page at {pathname}."),
                dcc.Link("All runs", href=href(app, "/")),
            ]
        )

    def shell(self, url: str | None = None) -> html.Div:
        """The app's frame, holding the page at browser URL `url` (None: empty, and the
        router fills it once the `dcc.Location` has read the browser's URL)."""
        drawn = content = None
        if url is not None:
            parts = urlsplit(url)
            search = f"?{parts.query}" if parts.query else ""
            content = self.page_at(parts.path, search)
            drawn = parts.path + search
        return html.Div(
            [
                # callback-nav: a callback that sets the URL (heatmap click → layer page)
                # navigates inside the app instead of reloading it.
                dcc.Location(id=ids.URL, refresh="callback-nav"),
                dcc.Store(id=ids.PAGE_DRAWN, data=drawn),
                dcc.Store(id=ids.ROUTE),
                html.Nav(
                    [
                        dcc.Link("ampwatch", href=href(self.app, "/")),
                        dcc.Link("compare", href=href(self.app, compare_path([])), className="nav"),
                    ],
                    className="topbar",
                ),
                html.Main(id=ids.PAGE, className="content", children=content),
            ]
        )

    def initial_layout(self) -> html.Div:
        """What `_dash-layout` serves. The browser sends that request with the page's URL
        as its Referer (same-origin), so the page comes with the layout: the first render
        skips a router round trip (~200 ms of idle browser). The browser then checks the
        URL it really has against the one drawn (`ROUTE_GUARD`): a Referer cut to its
        origin or stripped of its query by a privacy setting costs a redraw, never a wrong
        page. Without a Referer of this app, or when drawing the page fails, the frame
        comes empty and the router fills it."""
        referrer = flask.request.referrer if flask.has_request_context() else None
        prefix = self.app.config.requests_pathname_prefix
        # Dash also calls the layout function once for its own checks, in whatever
        # request comes first: only the layout's own request draws a page.
        if (
            referrer
            and urlsplit(referrer).path.startswith(prefix)
            and flask.request.path == "/_dash-layout"
        ):
            try:
                return self.shell(referrer)
            except Exception:  # a page's bug must not take the whole app down with it
                log.exception(
                    "drawing %s into the initial layout failed; the router will draw it", referrer
                )
        return self.shell()


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
    bundle = plotly_bundle.cartesian_bundle()
    generator_runtime.runtime_suffices()  # read Dash's scripts now, not in a first visit
    app = _Dash(
        __name__,
        requests_pathname_prefix=requests_pathname_prefix,
        routes_pathname_prefix="/",
        title="ampwatch",
        update_title="",  # keep the tab title steady while the page refreshes
        index_string=index_string(requests_pathname_prefix, bundled=bundle is not None),
    )
    prefetcher: Prefetcher[int, dict[str, Any]] = Prefetcher(
        lambda run_id: run_store.fetch_run_data(client, run_id)
    )
    add_server_hooks(app, prefetcher, bundle)
    router = Router(app, client, prefetcher)

    # Callbacks target ids that exist only once their page is shown; the validation
    # layout lists every page so Dash still checks each id instead of suppressing errors.
    # (Dash annotates `validation_layout` as None, though it documents a component.)
    # Set before the layout: Dash would otherwise call the layout function to make one.
    app.validation_layout = html.Div(  # type: ignore[assignment]
        [router.shell(), *(page.layout() for page in PAGES)]
    )
    app.layout = router.initial_layout

    app.clientside_callback(  # type: ignore[no-untyped-call]
        ROUTE_GUARD,
        Output(ids.ROUTE, "data"),
        Output(ids.PAGE_DRAWN, "data"),
        Input(ids.URL, "pathname"),
        State(ids.URL, "search"),
        State(ids.PAGE_DRAWN, "data"),
        prevent_initial_call=True,
    )

    @app.callback(Output(ids.PAGE, "children"), Input(ids.ROUTE, "data"), prevent_initial_call=True)
    def route(where: dict[str, Any]) -> Any:
        return router.page_at(where.get("pathname"), where.get("search"))

    for page in PAGES:
        page.register_callbacks(app, client)
    return app
