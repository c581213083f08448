"""The dashboard in headless Chromium, mounted in a real collector holding real ingested data.

One collector for the module: the divergence run of `divergence_run.py` (6,000 steps, a
loss-scale collapse, checkpoints) and a shorter healthy run, ingested over HTTP, so the
alerts and the restart advice on screen are the collector's own. Every test opens its page
in a fresh browser context and fails on any console error. Screenshots of every page go to
`artifacts/screenshots/` (gitignored), for people to look at.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from divergence_run import CHECKPOINTS, FROZEN, LAYERS, RUN_NAME, batches

from ampwatch.agent.wire import INGEST_PATH
from ampwatch.dashboard import ids
from ampwatch.dashboard.pages.run import HEATMAP_OPTIONS
from ampwatch.server.migrate import upgrade
from ampwatch.server.serving import BackgroundCollector, bind_socket
from ampwatch.server.settings import Settings

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "artifacts" / "screenshots"
RENDER_TIMEOUT_MS = 30_000
HEALTHY_NAME = "gpt-fp16-healthy"
HEALTHY_STEPS = 3000
RUN_GRAPHS = (
    ids.LOSS_SCALE_GRAPH,
    ids.SKIP_RATE_GRAPH,
    ids.GRAD_NORM_GRAPH,
    ids.ACTIVATION_NORM_GRAPH,
    ids.HEATMAP_GRAPH,
    ids.ALERTS_GRAPH,
)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason=f"needs Debian's chromium at {CHROMIUM} (playwright cannot download a browser here)",
    ),
]
sync_api = pytest.importorskip("playwright.sync_api")


def ingest(url: str, body: dict[str, Any]) -> None:
    response = httpx.post(url + INGEST_PATH, json=body, timeout=30)
    assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A collector with the dashboard mounted; run 1 diverges, run 2 stays healthy."""
    database_url = f"sqlite:///{tmp_path_factory.mktemp('browser') / 'ampwatch.db'}"
    upgrade(database_url)
    sock = bind_socket()
    settings = Settings(database_url=database_url, port=sock.getsockname()[1], dashboard=True)
    with BackgroundCollector(settings, sock=sock):
        for body in batches():
            ingest(settings.public_url, body)
        for body in batches(steps=HEALTHY_STEPS, client_run_id="healthy", name=HEALTHY_NAME):
            ingest(settings.public_url, body)
        yield settings.public_url


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh page; the test fails if the page logged any console error."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(str(error)))
    try:
        yield page
    finally:
        context.close()
    assert problems == [], problems


def screenshot(page: Any, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / name), full_page=True)
    print(f"screenshot: {SCREENSHOTS / name}")


def graph_traces(page: Any, graph_id: str) -> list[dict[str, Any]]:
    """Each trace of a rendered graph: name, type, point counts (heatmap: z rows' lengths).

    Read from plotly's `_fullData`: numeric arrays arrive as base64 typed arrays, which
    `data` keeps encoded and `_fullData` holds decoded, as drawn."""
    traces: list[dict[str, Any]] = page.evaluate(
        """(id) => (document.querySelector(`#${id} .js-plotly-plot`)?._fullData ?? []).map(t => ({
            name: t.name ?? null, type: t.type,
            x: (t.x ?? []).length, y: (t.y ?? []).length,
            z: Array.from(t.z ?? [], row => row.length),
        }))""",
        graph_id,
    )
    return traces


def wait_for_graphs(page: Any, *graph_ids: str) -> None:
    """Until every graph is drawn with data (not a "Loading…" placeholder)."""
    page.wait_for_function(
        """(ids) => ids.every(id => {
            const plot = document.querySelector(`#${id} .js-plotly-plot`);
            return plot && plot._fullLayout && (plot.data ?? []).length > 0
                && !(plot.layout.annotations ?? []).some(a => a.text === 'Loading…');
        })""",
        arg=list(graph_ids),
        timeout=RENDER_TIMEOUT_MS,
    )


def points_in(page: Any, graph_id: str, low: int, high: int) -> int:
    """Points of a graph's first trace with low <= x <= high."""
    count: int = page.evaluate(
        """([id, low, high]) => Array.from(
            document.querySelector(`#${id} .js-plotly-plot`)._fullData[0].x
        ).filter(x => x >= low && x <= high).length""",
        [graph_id, low, high],
    )
    return count


def test_a_visit_by_url_renders_without_the_router(collector: str, page: Any) -> None:
    """The run page comes inside the initial layout: no callback draws the page."""
    routed: list[str] = []
    page.on(
        "request",
        lambda r: (
            routed.append(r.url)
            if "_dash-update-component" in r.url and f'"{ids.PAGE}.children"' in (r.post_data or "")
            else None
        ),
    )
    page.goto(f"{collector}/dashboard/run/1")
    wait_for_graphs(page, *RUN_GRAPHS)
    assert routed == []


def test_the_page_keeps_the_browsers_natives_and_loads_dccs_chunks_once(
    collector: str, page: Any
) -> None:
    """Dash's polyfill replaces parseFloat, parseInt and the trims; the page puts the
    browser's own back. dcc's Graph and Dropdown chunks come with the scripts, once each,
    before the layout: dcc does not fetch them again when the charts mount."""
    requested: list[str] = []
    page.on("request", lambda r: requested.append(r.url.rsplit("/", 1)[-1].split("?")[0]))
    page.goto(f"{collector}/dashboard/run/1")
    wait_for_graphs(page, *RUN_GRAPHS)
    natives = page.evaluate(
        """() => [parseFloat, parseInt, Number.parseFloat, Number.parseInt,
            String.prototype.trim, String.prototype.trimStart, String.prototype.trimEnd]
            .map(f => f.toString().includes('[native code]'))"""
    )
    assert natives == [True] * 7
    assert page.evaluate("() => parseFloat(' 2.5e3 ') + ' x '.trim().length") == 2501
    chunks = [name for name in requested if name.startswith("async-")]
    assert sorted(chunks) == ["async-dropdown.js", "async-graph.js"]
    assert requested.index("async-graph.js") < requested.index("_dash-layout")


@pytest.mark.parametrize("referrer", ["another page", "no-referrer policy"])
def test_a_referrer_that_is_not_the_page_still_gets_the_page(
    collector: str, page: Any, referrer: str
) -> None:
    """A Referer naming another page (the runs list) draws that into the initial layout;
    the browser sees its URL is the run page and the router draws that. A proxy's
    `Referrer-Policy: no-referrer`: an empty frame, filled by the router."""
    if referrer == "another page":
        page.set_extra_http_headers({"Referer": f"{collector}/dashboard/"})
    else:
        page.route(
            "**/dashboard/run/1",
            lambda route: route.fulfill(
                response=route.fetch(), headers={"Referrer-Policy": "no-referrer"}
            ),
        )
    with page.expect_response(lambda r: "_dash-layout" in r.url) as layout:
        page.goto(f"{collector}/dashboard/run/1")
    drawn = {
        child["props"].get("id"): child["props"].get("data")
        for child in layout.value.json()["props"]["children"]
    }[ids.PAGE_DRAWN]
    assert drawn == ("/dashboard/" if referrer == "another page" else None)
    wait_for_graphs(page, *RUN_GRAPHS)
    assert page.locator(f"#{ids.RUNS_TABLE}").count() == 0


def test_runs_overview_shows_health_and_links(collector: str, page: Any) -> None:
    page.goto(f"{collector}/dashboard/")
    link = page.get_by_role("link", name=RUN_NAME)
    link.wait_for(timeout=RENDER_TIMEOUT_MS)
    rows = page.locator("table.runs tbody tr")
    first = rows.first.inner_text()  # worst health first
    assert RUN_NAME in first and "critical" in first and "6,000" in first
    assert "2^-8" in first and "ago" in first  # collapsed scale, age of the last data
    assert HEALTHY_NAME in rows.nth(1).inner_text() and "ok" in rows.nth(1).inner_text()
    screenshot(page, "runs.png")

    page.locator(f"#{ids.RUNS_FILTER_TEXT}").fill("healthy")
    page.wait_for_function("() => document.querySelectorAll('table.runs tbody tr').length === 1")
    assert HEALTHY_NAME in rows.first.inner_text()
    page.locator(f"#{ids.RUNS_FILTER_TEXT}").fill("")
    page.get_by_role("button", name="last step").click()  # sort: most steps first
    page.wait_for_function(
        "(name) => document.querySelector('table.runs tbody tr').innerText.includes(name)",
        arg=RUN_NAME,
    )

    link.click()  # client-side navigation under the /dashboard/ prefix
    page.wait_for_url(f"{collector}/dashboard/run/1")
    wait_for_graphs(page, *RUN_GRAPHS)


def test_run_page_plots_real_data_a_fired_alert_and_the_restart(collector: str, page: Any) -> None:
    page.goto(f"{collector}/dashboard/run/1")
    wait_for_graphs(page, *RUN_GRAPHS)
    assert page.title() == "ampwatch"

    loss_scale = {t["name"]: t for t in graph_traces(page, ids.LOSS_SCALE_GRAPH)}
    assert loss_scale["loss scale"]["x"] > 1000 and loss_scale["loss"]["y"] > 1000
    # Every skipped step is counted, however many share a downsampled marker.
    assert 3 < loss_scale["skipped step (24)"]["x"] <= 24
    assert loss_scale["non-finite loss"]["x"] > 0
    assert graph_traces(page, ids.SKIP_RATE_GRAPH)[0]["y"] > 10
    assert graph_traces(page, ids.GRAD_NORM_GRAPH)[0]["y"] > 1000
    activation = {t["name"]: t for t in graph_traces(page, ids.ACTIVATION_NORM_GRAPH)}
    assert activation["max over tokens"]["y"] > 1000
    # The collector's own threshold (the rule judged these steps): the band is gone.
    assert activation["alert threshold (activation_norm_spike)"]["y"] > 500
    (heatmap,) = graph_traces(page, ids.HEATMAP_GRAPH)
    assert heatmap["type"] == "heatmap" and len(heatmap["z"]) == 7
    # 300 sampled steps, shown as <= 200 columns (bucket maxima: a frozen layer still shows).
    assert 100 < heatmap["z"][0] <= 200
    frozen = page.evaluate(
        """([id, row]) => Array.from(
            document.querySelector(`#${id} .js-plotly-plot`)._fullData[0].z[row]).slice(-3)""",
        [ids.HEATMAP_GRAPH, LAYERS.index(FROZEN)],
    )
    assert frozen == [1.0, 1.0, 1.0]  # the layer that stopped learning, drawn red
    # Columns on evenly spaced bucket starts (`heatmap_figures.bucket_grid`), so plotly.js paints a
    # pixel per cell rather than filling each on a full-size canvas.
    assert (
        page.evaluate(
            "(id) => document.querySelector(`#${id} .js-plotly-plot`)._fullData[0]._islinear",
            ids.HEATMAP_GRAPH,
        )
        is True
    )
    timeline = {t["name"] for t in graph_traces(page, ids.ALERTS_GRAPH)}
    assert {"critical", "fired"} <= timeline

    # A fired alert with its explanation, and the recommended checkpoint, highlighted.
    firing = page.locator("li.alert-firing", has_text="loss_scale_collapse")
    assert firing.is_visible() and "below min_scale" in firing.inner_text()
    recommended = page.locator("tr.candidate-recommended")
    assert recommended.is_visible() and "4,000" in recommended.inner_text()
    assert page.get_by_text("Restart from step 4,000.").is_visible()
    assert page.locator("tr.candidate-rejected").count() == 2  # 5,000 and 5,500: collapsed
    restart = page.evaluate(
        """(id) => document.querySelector(`#${id} .js-plotly-plot`).layout.annotations
            .filter(a => a.text === 'restart here').map(a => a.x)""",
        ids.LOSS_SCALE_GRAPH,
    )
    assert restart == [4000] and 4000 in CHECKPOINTS
    screenshot(page, "run.png")

    page.get_by_text("flush-to-zero forecast").click()
    page.wait_for_function(
        """(id) => document.querySelector(`#${id} .js-plotly-plot`).layout.title.text
            .startsWith('Flush-to-zero')""",
        arg=ids.HEATMAP_GRAPH,
        timeout=RENDER_TIMEOUT_MS,
    )
    page.locator(f"#{ids.HEATMAP_GRAPH}").screenshot(path=str(SCREENSHOTS / "heatmap-flush.png"))


def _answers_autosize(response: Any) -> bool:
    """Whether `response` is the zoom callback's answer to the charts' own first relayout
    (autosize, emitted after the first draw)."""
    request = response.request.post_data_json or {}
    return (
        "_dash-update-component" in response.url
        and request.get("output") == f"{ids.RUN_ZOOM}.data"
        and any(
            (i.get("id"), i.get("value")) == (ids.LOSS_SCALE_GRAPH, {"autosize": True})
            for i in request.get("inputs", [])
        )
    )


def test_zoom_refetches_finer_data_from_the_collector(collector: str, page: Any) -> None:
    # Zoom only once the charts' autosize relayout is answered: Dash keeps only the latest
    # of overlapping calls of one callback, and the autosize call, sent after the zoom's
    # (as happens under load), would discard the zoom's answer with its no-update.
    with page.expect_response(_answers_autosize, timeout=RENDER_TIMEOUT_MS):
        page.goto(f"{collector}/dashboard/run/1")
        wait_for_graphs(page, *RUN_GRAPHS)
    low, high = 4600, 4800
    before = points_in(page, ids.LOSS_SCALE_GRAPH, low, high)
    assert before < high - low  # downsampled: fewer points than steps

    # The zoom callback's answer to this relayout; not to the charts' own relayout events
    # (autosize on first draw), which it answers with no update.
    with page.expect_response(
        lambda r: (
            "_dash-update-component" in r.url
            and (r.request.post_data_json or {}).get("output") == f"{ids.RUN_ZOOM}.data"
            and "xaxis.range" in (r.request.post_data or "")
        )
    ) as answer:
        page.evaluate(
            """([id, low, high]) => Plotly.relayout(
                document.querySelector(`#${id} .js-plotly-plot`), {'xaxis.range': [low, high]})""",
            [ids.LOSS_SCALE_GRAPH, low, high],
        )
    zoom = json.loads(answer.value.text())["response"][ids.RUN_ZOOM]["data"]
    assert (zoom["start"], zoom["end"]) == (low, high)  # the request's window
    assert zoom["steps"]["step"] == list(range(low, high + 1))  # every step, exact
    page.wait_for_function(
        "([id, n]) => document.querySelector(`#${id} .js-plotly-plot`)._fullData[0].x.length === n",
        arg=[ids.LOSS_SCALE_GRAPH, high - low + 1],
        timeout=RENDER_TIMEOUT_MS,
    )
    assert points_in(page, ids.LOSS_SCALE_GRAPH, low, high) == high - low + 1 > before
    # The other step charts follow the zoom.
    assert points_in(page, ids.GRAD_NORM_GRAPH, low, high) == high - low + 1
    screenshot(page, "run-zoomed.png")


def test_heatmap_click_opens_the_layer_page_with_its_histogram(collector: str, page: Any) -> None:
    page.goto(f"{collector}/dashboard/run/1")
    wait_for_graphs(page, ids.HEATMAP_GRAPH)
    layer = "blocks.2.mlp.fc2.weight"
    page.evaluate(  # what plotly emits when a heatmap cell is clicked
        """([id, layer]) => document.querySelector(`#${id} .js-plotly-plot`)
            .emit('plotly_click', {points: [{x: 3000, y: layer, z: 0}]})""",
        [ids.HEATMAP_GRAPH, layer],
    )
    page.wait_for_url(f"{collector}/dashboard/run/1/layer/{layer}?step=3000")
    wait_for_graphs(page, ids.LAYER_HISTOGRAM_GRAPH, ids.LAYER_SERIES_GRAPH)
    histogram = page.evaluate(
        """(id) => { const gd = document.querySelector(`#${id} .js-plotly-plot`);
            return {title: gd.layout.title.text, bars: gd._fullData[0].x.length,
                    frames: gd._transitionData._frames.length,
                    ranges: gd.data.slice(1).map(t => t.name)}; }""",
        ids.LAYER_HISTOGRAM_GRAPH,
    )
    assert histogram["title"] == f"Gradient exponents of {layer} at step 3,000"
    assert histogram["bars"] > 5 and histogram["frames"] >= 50
    assert histogram["ranges"] == ["normal range", "subnormal range"]
    series = {t["name"] for t in graph_traces(page, ids.LAYER_SERIES_GRAPH)}
    assert "would flush in FP16 (0 < |g·S| < 2^-24)" in series
    screenshot(page, "layer.png")

    page.get_by_text("▶ play").click()  # animated over steps: the title follows the frames
    page.wait_for_function(
        """(id) => !document.querySelector(`#${id} .js-plotly-plot`).layout.title.text
            .endsWith('step 3,000')""",
        arg=ids.LAYER_HISTOGRAM_GRAPH,
        timeout=RENDER_TIMEOUT_MS,
    )


def test_compare_overlays_two_runs(collector: str, page: Any) -> None:
    page.goto(f"{collector}/dashboard/compare?runs=1,2")
    wait_for_graphs(page, ids.COMPARE_GRAPH)
    traces = graph_traces(page, ids.COMPARE_GRAPH)
    assert [t["name"] for t in traces] == [RUN_NAME] * 3 + [HEALTHY_NAME] * 3
    assert all(t["y"] > 100 for t in traces)
    screenshot(page, "compare.png")


def test_live_run_appends_new_steps_without_a_reload(collector: str, page: Any) -> None:
    page.goto(f"{collector}/dashboard/run/2")
    wait_for_graphs(page, *RUN_GRAPHS[:-1])  # a healthy run: its alert timeline is empty
    assert page.get_by_text("No alert has fired for this run.").count() == 1
    page.evaluate("() => { window.notReloaded = true; }")
    before = graph_traces(page, ids.LOSS_SCALE_GRAPH)[0]["x"]
    *_, next_batch = batches(steps=HEALTHY_STEPS + 500, client_run_id="healthy", name=HEALTHY_NAME)
    with page.expect_response(
        lambda r: (
            "_dash-update-component" in r.url
            and ids.RUN_CURSOR in (r.request.post_data or "")  # the refresh callback
            and r.status == 200
        ),
        timeout=RENDER_TIMEOUT_MS,
    ) as answer:
        ingest(collector, next_batch)
    update = json.loads(answer.value.text())["response"][ids.RUN_DATA]["data"]
    extended = {
        tuple(op["location"]): op["params"]["value"]
        for op in update["operations"]
        if op["operation"] == "Extend"
    }
    assert extended[("steps", "step")] == list(range(HEALTHY_STEPS + 1, HEALTHY_STEPS + 501))
    page.wait_for_function(
        "([id, n]) => document.querySelector(`#${id} .js-plotly-plot`)._fullData[0].x.length === n",
        arg=[ids.LOSS_SCALE_GRAPH, before + 500],
        timeout=RENDER_TIMEOUT_MS,
    )
    assert page.evaluate("() => window.notReloaded") is True


def test_unknown_run_says_so_without_errors(collector: str, page: Any) -> None:
    page.goto(f"{collector}/dashboard/run/999")
    page.get_by_text("There is no run 999 on this collector.").wait_for(timeout=RENDER_TIMEOUT_MS)
    assert not page.locator(f"#{ids.RUN_GRAPHS}").is_visible()
    screenshot(page, "run-not-found.png")


def test_layer_dropdown_searches_the_run_layers_and_opens_one(collector: str, page: Any) -> None:
    """Its options come from the page's store in the browser: the typed text narrows them,
    and a pick opens the layer's page."""
    page.goto(f"{collector}/dashboard/run/1")
    wait_for_graphs(page, ids.HEATMAP_GRAPH)
    dropdown = page.locator(f"#{ids.RUN_LAYER_PICK}")
    dropdown.click()
    # Into its search box once it is open (typing blind could land before it is).
    dropdown_search = page.locator(".dash-dropdown-search")
    dropdown_search.wait_for(timeout=RENDER_TIMEOUT_MS)
    dropdown_search.press_sequentially("fc2")
    option = page.get_by_role("option", name="blocks.2.mlp.fc2.weight")
    option.wait_for(timeout=RENDER_TIMEOUT_MS)
    # That option is offered before the typed text narrows the list too: wait for the
    # narrowing itself (CI once read the whole list here).
    other = next(name for name in LAYERS if "fc2" not in name)
    page.get_by_role("option", name=other, exact=True).wait_for(
        state="detached", timeout=RENDER_TIMEOUT_MS
    )
    radios = {o["label"] for o in HEATMAP_OPTIONS}  # the statistic's radio items are options too
    offered = [o for o in page.get_by_role("option").all_inner_texts() if o not in radios]
    assert offered and all("fc2" in name for name in offered), offered
    assert len(offered) < len(LAYERS)
    option.click()
    page.wait_for_url(f"{collector}/dashboard/run/1/layer/blocks.2.mlp.fc2.weight")
    wait_for_graphs(page, ids.LAYER_SERIES_GRAPH)


def test_the_collector_compresses_what_the_dashboard_sends(collector: str) -> None:
    """For a browser across a network: page data and scripts go gzip-compressed."""
    for path in ("/dashboard/", "/dashboard/_dash-dependencies"):
        response = httpx.get(collector + path, headers={"Accept-Encoding": "gzip"}, timeout=30)
        assert response.status_code == 200
        assert response.headers["content-encoding"] == "gzip", path
    plain = httpx.get(
        collector + "/dashboard/", headers={"Accept-Encoding": "identity"}, timeout=30
    )
    assert "content-encoding" not in plain.headers and "<html" in plain.text.lower()
