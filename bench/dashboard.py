"""First render of the run page in headless Chromium, for a long run, and what it downloads.

    python bench/dashboard.py            # 100,000 steps x 500 parameter tensors (SQLite)
    python bench/dashboard.py --quick    # 10,000 steps x 100 tensors
    python bench/dashboard.py --steps 2000000 --layers 1000 --db-cache /tmp/awq
        # a three-week run, its database reused from (or left in) bench/query.py's cache

Bar (DESIGN.md, issue 6): the run page of a 100,000-step x 500-tensor run renders in
<= 2 s in the browser. The run is the query bench's (`bench/query.py`: every step's
scalars, layer statistics every 10 steps, stored through the collector's ingest code
in-process); `ampwatch serve` with its mounted dashboard runs in a subprocess, and Debian's
chromium (through Playwright) opens `/dashboard/run/1` in a fresh browser context each
round, so nothing is cached. "Rendered": every chart of the page holds plotted data.

Printed per round and as medians: milliseconds from navigation start to the rendered page
(cold; then again with the scripts cached; and from a click on the run in the runs list,
the dashboard already running),
the bytes of the dashboard's data responses (`_dash-layout`, which holds the page of a
visit by URL, and `_dash-update-component`: the fetched series and the figures), and the bytes of the page's scripts and styles (the Dash and Plotly
bundles, cached by a browser after the first visit). Also the startup floor: the same
cold visit of a page with one empty chart (Dash and plotly.js alone), measured in the same
rounds, so a loaded machine's figure can be read against it.

Measured (2 quiet cores, SQLite, 3 rounds x 4 runs, cartesian bundle): at 2,000,000 steps x
1,000 tensors, first render medians 1312-1496 ms against the 1,000 ms bar (floor 880-946 ms:
the run page's own share 416-617 ms); scripts cached 550-817 ms; from the runs list
515-656 ms. V8's compile hint on plotly.js (`//# allFunctionsCalledOnLoad`) moved the
medians by less than their spread (1312 / 1443 ms with, 1361 / 1496 ms without): not kept.
On a faster 2-core machine (3 rounds x 4 runs, twice): first render medians 960 / 945 ms
(bar 1,000 ms: met, with little to spare), floor 683 / 716 ms, scripts cached 468 / 429
ms, from the runs list 399 / 395 ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from collector import start_server
from query import database

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
]
GRAPHS = (
    "loss-scale-graph",
    "skip-rate-graph",
    "grad-norm-graph",
    "activation-norm-graph",
    "heatmap-graph",
    "alerts-graph",
)
#: Issue 29's bar for the run page's first render (2,000,000 steps x 1,000 tensors).
BAR_MS = 1000.0
FLOOR_RENDERED = """() => {
    const plot = document.querySelector('#compare-graph .js-plotly-plot');
    return plot && plot._fullLayout;
}"""
RENDERED = """(ids) => ids.every(id => {
    const plot = document.querySelector(`#${id} .js-plotly-plot`);
    return plot && plot.data && (plot.data.length > 0 || id === 'alerts-graph')
        && !(plot.layout.annotations || []).some(a => a.text === 'Loading…');
})"""


def startup_floor(browser: Any, url: str) -> float:
    """ms to draw the compare page with no run picked, cold: one empty chart, no data --
    what Dash and plotly.js cost on this machine before any of the run page's work."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.goto(f"{url}/dashboard/compare")
    page.wait_for_function(FLOOR_RENDERED, timeout=60_000, polling=20)
    elapsed = float(page.evaluate("() => performance.now()"))
    context.close()
    return elapsed


#: (kind, bytes) of each response the page fetched, from the browser's resource timing:
#: read after the render, so measuring sizes does not slow the render being measured.
SIZES = """() => performance.getEntriesByType('resource').map(e => [
    e.name.includes('/_dash-update-component') || e.name.includes('/_dash-layout') ? 'data'
        : (e.name.includes('/_dash-component-suites/') || e.name.includes('/_ampwatch/'))
        ? 'assets' : 'other',
    e.encodedBodySize, e.decodedBodySize])"""


def one_round(browser: Any, url: str) -> tuple[float, float, float, int, int, int, int]:
    """(ms to rendered cold, then warm, then in-app, data bytes, asset bytes as sent
    (compressed), then both decoded) of a visit
    of the run page in a fresh context, then of a second visit with the scripts in the
    cache, then of a click on the run in the runs overview (Dash and plotly.js already
    running: how an engineer who keeps the dashboard open gets there)."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{url}/dashboard/run/1")
    page.wait_for_function(RENDERED, arg=list(GRAPHS), timeout=60_000, polling=20)
    cold = float(page.evaluate("() => performance.now()"))
    sizes = {"data": 0, "assets": 0, "other": 0}
    decoded = dict(sizes)
    for kind, size, unpacked in page.evaluate(SIZES):
        sizes[kind] += int(size)
        decoded[kind] += int(unpacked)
    page.goto(f"{url}/dashboard/run/1")  # a new document: the scripts come from the cache
    page.wait_for_function(RENDERED, arg=list(GRAPHS), timeout=60_000, polling=20)
    warm = float(page.evaluate("() => performance.now()"))
    page.goto(f"{url}/dashboard/")
    page.wait_for_function("() => window.Plotly && window.Plotly.newPlot", timeout=60_000)
    link = page.locator('a[href$="/run/1"]')
    link.wait_for(timeout=60_000)
    clicked = float(page.evaluate("() => performance.now()"))
    link.click()
    page.wait_for_function(RENDERED, arg=list(GRAPHS), timeout=60_000, polling=20)
    in_app = float(page.evaluate("() => performance.now()")) - clicked
    context.close()
    if errors:
        raise RuntimeError(f"page errors: {errors}")
    return cold, warm, in_app, sizes["data"], sizes["assets"], decoded["data"], decoded["assets"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10,000 steps x 100 tensors")
    parser.add_argument("--rounds", type=int, help="cold page loads (median; 5, quick 2)")
    parser.add_argument("--steps", type=int, help="run length (default 100,000)")
    parser.add_argument("--layers", type=int, help="parameter tensors (default 500)")
    parser.add_argument("--db-cache", type=Path, help="keep and reuse the populated database")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    steps, layers = (10_000, 100) if args.quick else (100_000, 500)
    steps, layers = args.steps or steps, args.layers or layers
    rounds = args.rounds or (2 if args.quick else 5)
    with database("sqlite", steps, layers, args.db_cache) as database_url:
        assert database_url is not None  # SQLite is always there
        process, url = start_server(database_url, dashboard=True)
        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(
                    executable_path=str(CHROMIUM), args=CHROMIUM_ARGS
                )
                one_round(browser, url)  # warm the collector's caches and imports
                results, floors = [], []
                for i in range(rounds):
                    ms, warm, in_app, data, assets, raw_data, raw_assets = one_round(browser, url)
                    floors.append(startup_floor(browser, url))
                    results.append((ms, data, assets, warm, in_app, raw_data, raw_assets))
                    print(
                        f"round {i + 1}: first render {ms:6.0f} ms (scripts cached "
                        f"{warm:5.0f} ms, from the runs list {in_app:5.0f} ms), data "
                        f"{data / 1024:6.1f} KiB, scripts {assets / 1024:6.1f} KiB; "
                        f"startup floor {floors[-1]:5.0f} ms"
                    )
                browser.close()
        finally:
            process.terminate()
            process.wait(timeout=30)
    median_ms = statistics.median(r[0] for r in results)
    median_data = statistics.median(r[1] for r in results)
    verdict = "ok" if median_ms <= BAR_MS else "OVER"
    print(
        f"run page, {steps:,} steps x {layers} tensors: first render median "
        f"{median_ms:.0f} ms (bar {BAR_MS:.0f} ms, {verdict}); data sent to the browser "
        f"{median_data:,.0f} bytes ({median_data / 1024:.0f} KiB, "
        f"{results[0][5] / 1024:.0f} KiB decoded), plus {results[0][2] / 1024:.0f} KiB "
        f"of scripts on a cold cache ({results[0][6] / 1024:.0f} KiB decoded)"
    )
    print(
        f"with the scripts cached (a second visit): median "
        f"{statistics.median(r[3] for r in results):.0f} ms; from a click in the runs "
        f"list (the dashboard already open): median "
        f"{statistics.median(r[4] for r in results):.0f} ms"
    )
    print(
        f"startup floor (an empty chart, same browser, same moment): median "
        f"{statistics.median(floors):.0f} ms; the run page's own share "
        f"{median_ms - statistics.median(floors):.0f} ms"
    )
    return 0 if median_ms <= BAR_MS else 1


if __name__ == "__main__":
    sys.exit(main())
