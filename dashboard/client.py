"""A thin client over the collector's HTTP API (v1), the dashboard's only data source.

Answers come decoded: series in `ampwatch.dashboard.series_types` (whose docstring says
why NaN must survive the round trip through a `dcc.Store`), the run's summary, events,
alerts and advice in `ampwatch.dashboard.run_types`.

    >>> client = CollectorClient("http://127.0.0.1:8000")
    >>> [run.name for run in client.list_runs()]  # doctest: +SKIP
    ['gpt-small']
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import quote

import httpx

from ampwatch.agent.wire import API_PREFIX
from ampwatch.dashboard.run_types import Alert, RestartAdvice, RunEvent, RunSummary
from ampwatch.dashboard.series_types import (
    AbandonedTail,
    LayerHistograms,
    LayerMatrix,
    LayerSeries,
    StepSeries,
)

#: About two points per horizontal pixel of a wide chart: the most a browser can show.
STEP_POINTS = 2000
#: A 200 x 200 heatmap is ~0.3 MB of JSON; the 500 x 500 server default is ~4.6 MB.
HEATMAP_STEPS = 200
HEATMAP_LAYERS = 200
#: Histograms (animation frames) of one layer fetched for its drill-down page.
HISTOGRAM_FRAMES = 60
#: A layer dropdown lists at most this many parameter tensors.
MAX_LAYER_NAMES = 5000
#: Alerts of one run read at once (the collector's largest page; newest first).
MAX_ALERTS = 1000
NO_STEP = 2**63 - 1  # the largest step the API accepts; no run gets there
T = TypeVar("T")


class CollectorError(RuntimeError):
    """The collector could not answer; the message says what to check."""


class RunNotFound(CollectorError):
    """The collector answered 404 for a run id."""


class AnswerCache:
    """Tagged answers by URL, least recently used first out, at most `max_bytes` in all:
    one per dashboard app, shared by its viewers, so a run that a thousand people watch
    is read once per change. Bytes, not parsed objects: a caller may change what it got.
    Callbacks run on several threads, hence the lock.
    """

    def __init__(self, max_bytes: int = 64 * 1024 * 1024) -> None:
        self._max_bytes = max_bytes
        self._bytes = 0
        self._entries: OrderedDict[str, tuple[str, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, url: str) -> tuple[str, bytes] | None:
        with self._lock:
            entry = self._entries.get(url)
            if entry is not None:
                self._entries.move_to_end(url)
            return entry

    def put(self, url: str, tag: str, content: bytes) -> None:
        if len(content) > self._max_bytes // 4:  # one answer never evicts the rest
            return
        with self._lock:
            old = self._entries.pop(url, None)
            self._bytes -= len(old[1]) if old else 0
            self._entries[url] = (tag, content)
            self._bytes += len(content)
            while self._bytes > self._max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= len(evicted)


class CollectorClient:
    """Reads runs and their series from a collector; one instance per dashboard app.

    `transport` is for tests (`httpx.MockTransport`); by default requests go over HTTP.
    `token`: a bearer token for a collector that requires one.
    """

    def __init__(
        self,
        api_url: str,
        *,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
        token: str | None = None,
    ) -> None:
        self.api_url = api_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else None
        # No keep-alive: Dash has no shutdown hook to close this client, so a pooled idle
        # socket would outlive the app; a new loopback connection per request costs ~0.1 ms.
        self._http = httpx.Client(
            base_url=self.api_url + API_PREFIX,
            timeout=timeout,
            transport=transport,
            headers=headers,
            limits=httpx.Limits(max_keepalive_connections=0),
        )
        self._answers = AnswerCache()

    def _get(self, path: str, parse: Callable[[Any], T], **params: str | int | None) -> T:
        """GET `path` and parse its JSON; every failure becomes a `CollectorError`.

        Parameters that are None are left out (the collector's default applies). An
        answer the collector tagged is kept (`AnswerCache`) and asked for again with its
        tag: while the run has not changed, the collector answers 304 without its query."""
        query = {name: value for name, value in params.items() if value is not None}
        key = str(self._http.build_request("GET", path, params=query).url)
        held = self._answers.get(key)
        try:
            response = self._http.get(
                path, params=query, headers={"If-None-Match": held[0]} if held else None
            )
        except httpx.HTTPError as exc:
            raise CollectorError(
                f"cannot reach the collector at {self.api_url} ({exc}); is it running?"
            ) from exc
        if response.status_code == 404:
            raise RunNotFound(f"the collector has no {path}")
        if response.is_error:
            raise CollectorError(
                f"the collector answered {response.status_code} for {path}: {response.text[:200]}"
            )
        content = response.content
        if response.status_code == 304 and held is not None:
            content = held[1]
        elif "etag" in response.headers:
            self._answers.put(key, response.headers["etag"], content)
        try:
            return parse(json.loads(content))
        except (KeyError, TypeError, ValueError) as exc:
            raise CollectorError(
                f"unexpected answer from {path} ({type(exc).__name__}: {exc}); "
                "do the dashboard and collector versions match?"
            ) from exc

    def list_runs(self) -> list[RunSummary]:
        """All runs, newest first."""
        return self._get("/runs", lambda data: [RunSummary.from_json(r) for r in data["runs"]])

    def get_run(self, run_id: int) -> RunSummary:
        """One run; raises `RunNotFound` for an unknown id."""
        return self._get(f"/runs/{run_id}", RunSummary.from_json)

    def steps(
        self,
        run_id: int,
        *,
        rank: int = 0,
        start: int | None = None,
        end: int | None = None,
        max_points: int = STEP_POINTS,
    ) -> StepSeries:
        """Steps in [start, end] (default: all), downsampled by the collector (min/max per
        bucket: spikes and skips survive); a zoomed window gets finer buckets."""
        return self._get(
            f"/runs/{run_id}/steps",
            StepSeries.from_json,
            rank=rank,
            start=start,
            end=end,
            max_points=max_points,
        )

    def layer_matrix(
        self,
        run_id: int,
        stat: str,
        *,
        rank: int = 0,
        start: int | None = None,
        end: int | None = None,
        max_steps: int = HEATMAP_STEPS,
        max_layers: int = HEATMAP_LAYERS,
    ) -> LayerMatrix:
        """Downsampled on both axes by the collector (max per cell: a frozen layer shows)."""
        return self._get(
            f"/runs/{run_id}/layers",
            LayerMatrix.from_json,
            stat=stat,
            rank=rank,
            start=start,
            end=end,
            max_steps=max_steps,
            max_layers=max_layers,
        )

    def layer_names(self, run_id: int) -> list[str]:
        """Every parameter tensor of the run, in model order: the matrix's columns over a
        window past any step, so that no row is read."""
        return self._get(
            f"/runs/{run_id}/layers",
            lambda d: [str(n) for n in d["layers"]],
            start=NO_STEP,
            end=NO_STEP,
            max_layers=MAX_LAYER_NAMES,
        )

    def layer_series(
        self,
        run_id: int,
        layer: str,
        stat: str,
        *,
        rank: int = 0,
        start: int | None = None,
        end: int | None = None,
        max_points: int = STEP_POINTS,
    ) -> LayerSeries:
        return self._get(
            f"/runs/{run_id}/layers/{quote(layer, safe='')}/series",
            LayerSeries.from_json,
            stat=stat,
            rank=rank,
            start=start,
            end=end,
            max_points=max_points,
        )

    def layer_histograms(
        self,
        run_id: int,
        layer: str,
        *,
        rank: int = 0,
        start: int | None = None,
        max_points: int = HISTOGRAM_FRAMES,
    ) -> LayerHistograms:
        """The layer's exponent histograms from step `start` on, evenly thinned by the
        collector to `max_points` (1: the first one at or after `start`)."""
        return self._get(
            f"/runs/{run_id}/layers/{quote(layer, safe='')}/histograms",
            LayerHistograms.from_json,
            rank=rank,
            start=start,
            max_points=max_points,
        )

    def alerts(self, run_id: int) -> list[Alert] | None:
        """The run's alerts, or None when this collector has no alert engine (404)."""
        return self._get_optional(
            f"/runs/{run_id}/alerts",
            lambda d: [Alert.from_json(a) for a in d["alerts"]],
            limit=MAX_ALERTS,
        )

    def restart_candidates(self, run_id: int) -> RestartAdvice | None:
        """The restart advisor's verdicts, or None when this collector has no advisor (404)."""
        return self._get_optional(f"/runs/{run_id}/restart-candidates", RestartAdvice.from_json)

    def fp8_readiness(self, run_id: int) -> dict[str, Any] | None:
        """The run's FP8 readiness (the collector's JSON), or None without the route."""
        return self._get_optional(f"/runs/{run_id}/fp8-readiness", dict)

    def loss_scale_advice(self, run_id: int) -> dict[str, Any] | None:
        """FP16 loss-scale advice (the collector's JSON), or None without the route."""
        return self._get_optional(f"/runs/{run_id}/loss-scale-advice", dict)

    def _get_optional(self, path: str, parse: Callable[[Any], T], **params: str | int) -> T | None:
        # Called after the run itself was read, so a 404 means the route is missing.
        try:
            return self._get(path, parse, **params)
        except RunNotFound:
            return None

    def abandoned_steps(self, run_id: int) -> list[AbandonedTail]:
        """Rank 0's tails abandoned by resumes, oldest first ([] from a collector without
        the route)."""
        tails = self._get_optional(
            f"/runs/{run_id}/abandoned-steps",
            lambda data: [AbandonedTail.from_json(t) for t in data["tails"]],
        )
        return tails or []

    def events(self, run_id: int) -> list[RunEvent]:
        return self._get(
            f"/runs/{run_id}/events", lambda data: [RunEvent.from_json(e) for e in data["events"]]
        )
