"""A thin client over the collector's HTTP API (v1), the dashboard's only data source.

Answers are decoded into small dataclasses whose floats are Python floats, NaN and ±Inf
included (the wire carries them as strings, `ampwatch.agent.wire`). Each dataclass also
turns back into the API's JSON shape (`to_json` / `from_json`): a `dcc.Store` holds that
shape, because Dash's JSON encoder would silently turn NaN into null and the dashboard
must tell "not measured" (null) from "measured NaN".

    >>> client = CollectorClient("http://127.0.0.1:8000")
    >>> [run.name for run in client.list_runs()]  # doctest: +SKIP
    ['gpt-small']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import httpx

from ampwatch.agent.wire import STEP_FLOAT_FIELDS, WireFloat, decode_float, encode_float

API_PREFIX = "/api/v1"
#: About two points per horizontal pixel of a wide chart: the most a browser can show.
STEP_POINTS = 2000
#: A 200 x 200 heatmap is ~0.3 MB of JSON; the 500 x 500 server default is ~4.6 MB.
HEATMAP_STEPS = 200
HEATMAP_LAYERS = 200
T = TypeVar("T")


class CollectorError(RuntimeError):
    """The collector could not answer; the message says what to check."""


class RunNotFound(CollectorError):
    """The collector answered 404 for a run id."""


def _decode_all(values: list[WireFloat | None]) -> list[float | None]:
    return [decode_float(v) for v in values]


def _encode_all(values: list[float | None]) -> list[WireFloat | None]:
    return [encode_float(v) for v in values]


@dataclass(frozen=True)
class RunSummary:
    """One row of `GET /runs` (the API's `RunPublic`)."""

    id: int
    client_run_id: str
    name: str
    project: str
    status: str
    created_at: str
    last_seen_at: str
    steps: int
    last_step: int | None
    last_loss_scale: float | None
    skipped_steps: int

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSummary:
        return cls(
            id=int(data["id"]),
            client_run_id=str(data["client_run_id"]),
            name=str(data["name"]),
            project=str(data["project"]),
            status=str(data["status"]),
            created_at=str(data["created_at"]),
            last_seen_at=str(data["last_seen_at"]),
            steps=int(data["steps"]),
            last_step=data.get("last_step"),
            last_loss_scale=decode_float(data.get("last_loss_scale")),
            skipped_steps=int(data["skipped_steps"]),
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "last_loss_scale": encode_float(self.last_loss_scale)}


@dataclass(frozen=True)
class StepSeries:
    """`GET /runs/{id}/steps`: per-step columns, aligned by index, ordered by step."""

    step: list[int]
    loss: list[float | None]
    loss_scale: list[float | None]
    skipped: list[bool]
    grad_norm: list[float | None]
    lr: list[float | None]
    act_norm_mean: list[float | None]
    act_norm_max: list[float | None]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepSeries:
        steps = [int(s) for s in data.get("step", [])]
        # A column the collector left out reads as "not measured" rather than failing.
        floats = {
            name: _decode_all(data.get(name) or [None] * len(steps)) for name in STEP_FLOAT_FIELDS
        }
        skipped = [bool(s) for s in data.get("skipped") or [False] * len(steps)]
        return cls(step=steps, skipped=skipped, **floats)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"step": self.step, "skipped": self.skipped}
        for name in STEP_FLOAT_FIELDS:
            data[name] = _encode_all(getattr(self, name))
        return data


@dataclass(frozen=True)
class LayerMatrix:
    """`GET /runs/{id}/layers?stat=...`: `values[i][j]` is layer `layers[j]` at `steps[i]`."""

    stat: str
    layers: list[str]
    steps: list[int]
    values: list[list[float | None]]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LayerMatrix:
        return cls(
            stat=str(data.get("stat", "")),
            layers=[str(name) for name in data.get("layers", [])],
            steps=[int(s) for s in data.get("steps", [])],
            values=[_decode_all(row) for row in data.get("values", [])],
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "stat": self.stat,
            "layers": self.layers,
            "steps": self.steps,
            "values": [_encode_all(row) for row in self.values],
        }


@dataclass(frozen=True)
class RunEvent:
    """One entry of `GET /runs/{id}/events` (run start, checkpoint, run end, finding)."""

    kind: str
    step: int | None
    time: float
    data: dict[str, Any]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunEvent:
        return cls(
            kind=str(data["kind"]),
            step=data.get("step"),
            time=float(data["time"]),
            data=dict(data.get("data") or {}),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


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

    def _get(self, path: str, parse: Callable[[Any], T], **params: str | int) -> T:
        """GET `path` and parse its JSON; every failure becomes a `CollectorError`."""
        try:
            response = self._http.get(path, params=params)
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
        try:
            return parse(response.json())
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

    def steps(self, run_id: int, *, rank: int = 0, max_points: int = STEP_POINTS) -> StepSeries:
        """Downsampled by the collector (min/max per bucket: spikes and skips survive)."""
        return self._get(f"/runs/{run_id}/steps", StepSeries.from_json, rank=rank,
                         max_points=max_points)

    def layer_matrix(self, run_id: int, stat: str, *, rank: int = 0,
                     max_steps: int = HEATMAP_STEPS, max_layers: int = HEATMAP_LAYERS
                     ) -> LayerMatrix:
        """Downsampled on both axes by the collector (max per cell: a frozen layer shows)."""
        return self._get(f"/runs/{run_id}/layers", LayerMatrix.from_json, stat=stat, rank=rank,
                         max_steps=max_steps, max_layers=max_layers)

    def events(self, run_id: int) -> list[RunEvent]:
        return self._get(
            f"/runs/{run_id}/events", lambda data: [RunEvent.from_json(e) for e in data["events"]]
        )
