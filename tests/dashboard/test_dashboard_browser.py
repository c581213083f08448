"""The dashboard in headless Chromium, mounted in a real collector holding real ingested data."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ampwatch.agent.wire import INGEST_PATH, WIRE_VERSION, encode_float
from ampwatch.dashboard import ids

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
RENDER_TIMEOUT_MS = 15_000

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason=f"needs Debian's chromium at {CHROMIUM} (playwright cannot download a browser here)",
    ),
]
sync_api = pytest.importorskip("playwright.sync_api")

LAYERS = ["embed.weight", "blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight", "head.weight"]
SKIPPED = {10, 11, 25}
NON_FINITE_LOSS = {11: "Infinity", 25: "NaN"}
LAYER_EVERY = 5


def batch(seq: int, first: int, last: int) -> dict[str, Any]:
    """Steps `first..last`: the scale halves after each skip; `head.weight` is frozen."""
    scale = 65536.0 / 2 ** sum(1 for s in SKIPPED if s < first)
    steps = []
    for step in range(first, last + 1):
        steps.append(
            {
                "step": step,
                "rank": 0,
                "skipped": step in SKIPPED,
                "loss": NON_FINITE_LOSS.get(step, encode_float(3.0 - 0.02 * step)),
                "loss_scale": scale,
                "grad_norm": 1.0,
                "lr": 1e-3,
                "act_norm_mean": 8.0 + 0.01 * step,
                "act_norm_max": 12.0 + 0.1 * step,
            }
        )
        if step in SKIPPED:
            scale /= 2
    layer_stats = [
        {
            "step": step,
            "rank": 0,
            "names": LAYERS,
            "stats": {"zero_fraction": [0.0, 0.05, 0.2, 1.0]},
        }
        for step in range(first, last + 1)
        if step % LAYER_EVERY == 0
    ]
    events = [{"kind": "checkpoint", "step": 20, "time": 1.7e9 + 20, "data": {"path": "/c/20"}}]
    return {
        "wire_version": WIRE_VERSION,
        "run": {"client_run_id": "browser-test", "name": "gpt-small-fp16", "project": "default"},
        "stream": "0",
        "seq": seq,
        "steps": steps,
        "layer_stats": layer_stats,
        "events": events if first <= 20 <= last else [],
        "dropped": {"steps": 0, "layer_stats": 0, "events": 0},
    }


def ingest(url: str, body: dict[str, Any]) -> None:
    response = httpx.post(url + INGEST_PATH, json=body, timeout=10)
    assert response.status_code == 200, response.text


@pytest.fixture
def page() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 900})
        finally:
            browser.close()


def graph_traces(page: Any, graph_id: str) -> list[dict[str, Any]]:
    """Each trace of a rendered graph: its name and how many points (or heatmap rows) it has."""
    traces: list[dict[str, Any]] = page.evaluate(
        """(id) => (document.querySelector(`#${id} .js-plotly-plot`)?.data ?? []).map(t => ({
            name: t.name ?? null, type: t.type,
            x: (t.x ?? []).length, y: (t.y ?? []).length,
            z: (t.z ?? []).map(row => row.length),
        }))""",
        graph_id,
    )
    return traces


def wait_for_traces(page: Any, graph_id: str) -> None:
    page.wait_for_function(
        "(id) => (document.querySelector(`#${id} .js-plotly-plot`)?.data ?? []).length > 0",
        arg=graph_id,
        timeout=RENDER_TIMEOUT_MS,
    )


def test_runs_list_and_run_page_render_real_data(live_collector: Any, page: Any) -> None:
    ingest(live_collector.url, batch(0, 1, 40))
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(str(error)))
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    page.goto(f"{live_collector.url}/dashboard/")
    link = page.get_by_role("link", name="gpt-small-fp16")
    link.wait_for(timeout=RENDER_TIMEOUT_MS)
    row = page.locator("table.runs tbody tr").first.inner_text()
    assert "running" in row and "40" in row and "3" in row  # last step, skipped steps
    page.screenshot(path=str(SCREENSHOTS / "runs.png"), full_page=True)

    link.click()  # client-side navigation under the /dashboard/ prefix
    page.wait_for_url(f"{live_collector.url}/dashboard/run/*")
    for graph_id in (ids.LOSS_SCALE_GRAPH, ids.ACTIVATION_NORM_GRAPH, ids.ZERO_FRACTION_GRAPH):
        wait_for_traces(page, graph_id)
    assert page.locator(".js-plotly-plot").count() == 3
    assert page.title() == "ampwatch"  # no "Updating..." flicker on every refresh

    loss_scale = {t["name"]: t for t in graph_traces(page, ids.LOSS_SCALE_GRAPH)}
    assert loss_scale["loss scale"]["x"] == 40
    assert loss_scale["skipped step (3)"]["x"] == len(SKIPPED)
    assert loss_scale["loss"]["y"] == 40
    assert loss_scale["non-finite loss"]["x"] == len(NON_FINITE_LOSS)
    activation = graph_traces(page, ids.ACTIVATION_NORM_GRAPH)
    assert [(t["name"], t["y"]) for t in activation] == [
        ("max over tokens", 40),
        ("mean over tokens", 40),
    ]
    (heatmap,) = graph_traces(page, ids.ZERO_FRACTION_GRAPH)
    assert heatmap["type"] == "heatmap"
    assert heatmap["z"] == [40 // LAYER_EVERY] * len(LAYERS)  # layers × steps
    frozen_row = page.evaluate(
        f"document.querySelector('#{ids.ZERO_FRACTION_GRAPH} .js-plotly-plot').data[0].z[3]"
    )
    assert frozen_row == [1.0] * (40 // LAYER_EVERY)
    page.screenshot(path=str(SCREENSHOTS / "run.png"), full_page=True)

    # A live run: the next batch appears without a reload, at the next refresh.
    ingest(live_collector.url, batch(1, 41, 60))
    page.wait_for_function(
        """(id) => document.querySelector(`#${id} .js-plotly-plot`).data[0].x.length === 60""",
        arg=ids.LOSS_SCALE_GRAPH,
        timeout=RENDER_TIMEOUT_MS,
    )
    assert problems == []


def test_unknown_run_says_so_without_errors(live_collector: Any, page: Any) -> None:
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.goto(f"{live_collector.url}/dashboard/run/999")
    page.get_by_text("There is no run 999 on this collector.").wait_for(timeout=RENDER_TIMEOUT_MS)
    assert not page.locator(f"#{ids.RUN_GRAPHS}").is_visible()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "run-not-found.png"), full_page=True)
    assert problems == []
