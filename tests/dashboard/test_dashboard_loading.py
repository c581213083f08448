"""What makes the dashboard's first render fast: the plotly.js bundle it serves (fetched
over real HTTP, checked against its pinned hash) and the run data read ahead of the
router callback."""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import tarfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import pytest

from ampwatch.dashboard import compare_figures, layer_figures, plotly_bundle
from ampwatch.dashboard.app import BUNDLE_ROUTE, create_dash_app
from ampwatch.dashboard.client import CollectorClient
from ampwatch.dashboard.pages.run import render_run
from ampwatch.dashboard.pages.run_store import fetch_run_data
from ampwatch.dashboard.prefetch import Prefetcher
from ampwatch.dashboard.series_types import LayerHistograms, StepSeries

SCRIPT = b"window.Plotly = {version: 'test'};\n"


def tarball(member: str = plotly_bundle.MEMBER, content: bytes = SCRIPT) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        info = tarfile.TarInfo(member)
        info.size = len(content)
        archive.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def integrity(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


@pytest.fixture
def registry() -> Iterator[tuple[str, dict[str, Any]]]:
    """A real HTTP server standing in for the npm registry: serves `state["body"]` and
    counts requests."""
    state: dict[str, Any] = {"body": tarball(), "requests": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            state["requests"] += 1
            self.send_response(200)
            self.send_header("Content-Length", str(len(state["body"])))
            self.end_headers()
            self.wfile.write(state["body"])

        def log_message(self, *_args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/bundle.tgz", state
    server.shutdown()
    server.server_close()


def test_fetch_stores_the_bundle_once_and_only_when_its_hash_matches(
    registry: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    url, state = registry
    with pytest.raises(ValueError, match="sha512"):
        plotly_bundle.fetch(tmp_path, url=url, integrity=integrity(b"another file"))
    assert list(tmp_path.iterdir()) == []  # nothing half-written to serve

    path = plotly_bundle.fetch(tmp_path, url=url, integrity=integrity(state["body"]))
    assert path == plotly_bundle.bundle_path(tmp_path)
    assert path.read_bytes() == SCRIPT
    assert plotly_bundle.cartesian_bundle(tmp_path) == path
    plotly_bundle.fetch(tmp_path, url=url, integrity=integrity(state["body"]))
    assert state["requests"] == 2  # the second good call found the file and asked nothing


def test_fetch_rejects_a_tarball_without_the_bundle(
    registry: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    url, state = registry
    state["body"] = tarball(member="package/README.md")
    with pytest.raises(ValueError, match="holds no"):
        plotly_bundle.fetch(tmp_path, url=url, integrity=integrity(state["body"]))
    assert not plotly_bundle.bundle_path(tmp_path).exists()


def test_the_pinned_bundle_is_the_plotly_js_the_figures_are_written_for() -> None:
    """The bundle is served only when its version is the installed plotly package's
    plotly.js; this says when a plotly upgrade turns that off (the full bundle is served,
    slower), so the pin gets bumped."""
    assert plotly_bundle.plotlyjs_version() == plotly_bundle.VERSION


def test_a_missing_bundle_falls_back_to_plotly_full_bundle(tmp_path: Path) -> None:
    assert plotly_bundle.cartesian_bundle(tmp_path) is None


def index_and_bundle(
    monkeypatch: pytest.MonkeyPatch, folder: Path
) -> tuple[str, tuple[bytes, str, int | None]]:
    """The index page and (body, type, max-age) of the bundle's URL, with the assets
    folder at `folder`."""
    monkeypatch.setenv("AMPWATCH_ASSETS_DIR", str(folder))
    app = create_dash_app("http://collector.test", requests_pathname_prefix="/dashboard/")
    client = app.server.test_client()
    response = client.get(f"/{BUNDLE_ROUTE}")
    bundle = (response.get_data(), response.mimetype, response.cache_control.max_age)
    response.close()
    return client.get("/").get_data(as_text=True), bundle


def test_the_app_serves_the_fetched_bundle_and_loads_it_once_dash_has_started(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    plotly_bundle.bundle_path(tmp_path).write_bytes(SCRIPT)
    index, bundle = index_and_bundle(monkeypatch, tmp_path)
    assert f'script.src = "/dashboard/{BUNDLE_ROUTE}"' in index
    # After Dash's scripts (not competing with them) and its renderer, whose layout request
    # is then out: the bundle loads while the server draws the page.
    assert index.index("<script>ampwatchLoadPlotly()</script>") > index.index("new DashRenderer")
    assert bundle == (SCRIPT, "text/javascript", 31_536_000)  # the name carries the version
    assert "/dash/dcc/dash_core_components" in index
    assert "/dash_table/bundle" not in index  # no page draws a DataTable: not loaded


def test_the_bundle_is_sent_gzipped_once_compressed_to_a_browser_that_accepts_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    script = SCRIPT * 200
    plotly_bundle.bundle_path(tmp_path).write_bytes(script)
    monkeypatch.setenv("AMPWATCH_ASSETS_DIR", str(tmp_path))
    app = create_dash_app("http://collector.test", requests_pathname_prefix="/dashboard/")
    client = app.server.test_client()
    zipped = client.get(f"/{BUNDLE_ROUTE}", headers={"Accept-Encoding": "gzip, br"})
    assert zipped.headers["Content-Encoding"] == "gzip"
    assert zipped.headers["Vary"] == "Accept-Encoding"
    assert len(zipped.get_data()) < len(script) / 10
    assert gzip.decompress(zipped.get_data()) == script
    plain = client.get(f"/{BUNDLE_ROUTE}")
    assert "Content-Encoding" not in plain.headers
    assert plain.get_data() == script


def test_without_the_bundle_the_app_loads_plotly_full_bundle(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    index, bundle = index_and_bundle(monkeypatch, tmp_path)
    assert (
        'script.src = "/dashboard/_dash-component-suites/plotly/package_data/plotly.min.js"'
    ) in index
    assert bundle[1] == "text/html"  # no such file: Dash's catch-all answers with its page


def test_every_trace_the_pages_draw_is_one_the_cartesian_bundle_has(
    run_json: dict[str, Any],
    steps_json: dict[str, Any],
    layers_json: dict[str, Any],
    collector_transport: Any,
) -> None:
    """plotly.js draws nothing for a trace type its bundle lacks, silently: every figure
    of the run, compare and layer pages stays within the cartesian bundle's types."""
    client = CollectorClient("http://collector.test", transport=collector_transport())
    built = [
        f for f in render_run(fetch_run_data(client, run_json["id"])) if isinstance(f, go.Figure)
    ]
    hists = LayerHistograms(layer="head.weight", steps=[10], offsets=[100], counts=[[1, 2]])
    built += [
        compare_figures.compare_figure([("a", StepSeries.from_json(steps_json))]),
        layer_figures.exponent_histogram_figure(hists, [1024.0]),
    ]
    types = {trace.type for figure in built for trace in figure.data}
    for frame in built[-1].frames:
        types |= {trace.type for trace in frame.data}
    assert {"scatter", "heatmap", "bar"} <= types <= plotly_bundle.CARTESIAN_TRACES, types


def test_prefetch_hands_a_fresh_result_to_one_taker_only() -> None:
    calls: list[int] = []

    def read(run_id: int) -> dict[str, int]:
        calls.append(run_id)
        return {"run": run_id}

    now = [0.0]
    prefetcher: Prefetcher[int, dict[str, int]] = Prefetcher(
        read, fresh_seconds=0.2, most=2, clock=lambda: now[0]
    )
    prefetcher.start(1)
    prefetcher.start(1)  # already on its way: not read twice
    assert prefetcher.take(1) == {"run": 1} and prefetcher.take(1) is None
    assert calls == [1]
    prefetcher.start(2)
    now[0] += 0.3
    assert prefetcher.take(2) is None  # stale: the caller reads fresh data itself
    for run_id in (3, 4, 5):
        prefetcher.start(run_id)
    assert prefetcher.take(3) is None and prefetcher.take(5) == {"run": 5}  # oldest dropped


def test_a_failed_prefetch_leaves_the_read_to_the_caller() -> None:
    def read(_run_id: int) -> None:
        raise RuntimeError("collector down")

    prefetcher: Prefetcher[int, None] = Prefetcher(read)
    prefetcher.start(1)
    assert prefetcher.take(1) is None
