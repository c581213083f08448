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

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar
from urllib.parse import quote

import httpx

from ampwatch.agent.wire import (
    API_PREFIX,
    STEP_FLOAT_FIELDS,
    WireFloat,
    decode_float,
    encode_float,
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
    #: 'ok' | 'warning' | 'critical': the worst firing alert (kept by the alert engine).
    health: str = "ok"
    #: Skipped share over the run's last ~1,024 steps (the collector's recent rollups).
    skip_rate: float | None = None

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
            health=str(data.get("health") or "ok"),
            skip_rate=data.get("skip_rate"),
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "last_loss_scale": encode_float(self.last_loss_scale)}


@dataclass(frozen=True)
class RuleLines:
    """A step series' `rule_lines`: what the run's rules judge it by, with its effective
    settings (the collector's `ampwatch.server.rule_lines`, where each field is named)."""

    act_field: str | None
    act_enabled: bool
    min_ratio: float
    z_threshold: float
    baseline_steps: int
    min_baseline_steps: int
    min_scale: float
    scaler_floor: float | None
    floor_headroom_octaves: int
    floor_headroom_scale: float | None

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> RuleLines | None:
        if not data:
            return None
        act, scale = data["activation"], data["loss_scale"]
        return cls(
            act_field=act["field"], act_enabled=bool(act["enabled"]),
            min_ratio=float(act["min_ratio"]), z_threshold=float(act["z_threshold"]),
            baseline_steps=int(act["baseline_steps"]),
            min_baseline_steps=int(act["min_baseline_steps"]),
            min_scale=float(scale["min_scale"]), scaler_floor=scale.get("scaler_floor"),
            floor_headroom_octaves=int(scale["floor_headroom_octaves"]),
            floor_headroom_scale=scale.get("floor_headroom_scale"),
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {
            "activation": {
                "field": self.act_field, "enabled": self.act_enabled,
                "min_ratio": self.min_ratio, "z_threshold": self.z_threshold,
                "baseline_steps": self.baseline_steps,
                "min_baseline_steps": self.min_baseline_steps,
            },
            "loss_scale": {
                "min_scale": self.min_scale, "scaler_floor": self.scaler_floor,
                "floor_headroom_octaves": self.floor_headroom_octaves,
                "floor_headroom_scale": self.floor_headroom_scale,
            },
        }  # fmt: skip


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
    #: The grad norm after the loop's clip (`grad_norm` is before it); None where unclipped.
    grad_norm_clipped: list[float | None]
    #: The activation norm before the final norm; None where not measured.
    act_prenorm_mean: list[float | None]
    act_prenorm_max: list[float | None]
    adam_rms_max: list[float | None]
    update_ratio_max: list[float | None]
    #: Steps each point stands for that were skipped (1/0 for exact rows).
    skipped_count: list[int]
    #: Steps per bucket: 1 = exact rows; else two points (min, max) per bucket.
    bucket_width: int = 1
    #: activation_norm_spike's firing threshold per point, as the collector's rule engine
    #: judged it (None: not judged), and the steps a point stands for judged above it.
    act_threshold: list[float | None] = field(default_factory=list)
    act_above_count: list[int] = field(default_factory=list)
    #: None from a collector that predates them: the charts then draw no rule line.
    rule_lines: RuleLines | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepSeries:
        steps = [int(s) for s in data.get("step", [])]
        # A column the collector left out reads as "not measured" rather than failing.
        floats = {
            name: _decode_all(data.get(name) or [None] * len(steps)) for name in STEP_FLOAT_FIELDS
        }
        skipped = [bool(s) for s in data.get("skipped") or [False] * len(steps)]
        counts = data.get("skipped_count") or [int(s) for s in skipped]
        return cls(
            step=steps,
            skipped=skipped,
            skipped_count=[int(c) for c in counts],
            bucket_width=int(data.get("bucket_width") or 1),
            act_threshold=_decode_all(data.get("act_threshold") or [None] * len(steps)),
            act_above_count=[int(c) for c in data.get("act_above_count") or [0] * len(steps)],
            rule_lines=RuleLines.from_json(data.get("rule_lines")),
            **floats,
        )

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "step": self.step,
            "skipped": self.skipped,
            "skipped_count": self.skipped_count,
            "bucket_width": self.bucket_width,
            "act_threshold": _encode_all(self.act_threshold),
            "act_above_count": self.act_above_count,
            "rule_lines": None if self.rule_lines is None else self.rule_lines.to_json(),
        }
        for name in STEP_FLOAT_FIELDS:
            data[name] = _encode_all(getattr(self, name))
        return data

    @property
    def last_step(self) -> int | None:
        return self.step[-1] if self.step else None


#: The columns of a step series in the store (`StepSeries.to_json`) that grow with steps.
STEP_COLUMNS = (
    "step", "skipped", "skipped_count", "act_threshold", "act_above_count", *STEP_FLOAT_FIELDS,
)  # fmt: skip


@dataclass(frozen=True)
class LayerMatrix:
    """`GET /runs/{id}/layers?stat=...`: `values[i][j]` is layer `layers[j]` at `steps[i]`."""

    stat: str
    layers: list[str]
    steps: list[int]
    values: list[list[float | None]]
    #: Steps per row: > 1 when the collector merged rows (`steps[i]` starts the bucket).
    step_width: int = 1

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LayerMatrix:
        return cls(
            stat=str(data.get("stat", "")),
            layers=[str(name) for name in data.get("layers", [])],
            steps=[int(s) for s in data.get("steps", [])],
            values=[_decode_all(row) for row in data.get("values", [])],
            step_width=int(data.get("step_width") or 1),
        )

    @property
    def next_step(self) -> int | None:
        """The first step after the last row's bucket: where newer rows start."""
        return self.steps[-1] + self.step_width if self.steps else None

    def to_json(self, *, decimals: int | None = None) -> dict[str, Any]:
        """The API's shape; `decimals` rounds finite values (a store for display needs no
        more than a colour's precision, and 0.1234 is a third of 0.12345678901234567)."""
        rows = (
            self.values
            if decimals is None
            else [
                [v if v is None or not math.isfinite(v) else round(v, decimals) for v in row]
                for row in self.values
            ]
        )
        return {
            "stat": self.stat,
            "layers": self.layers,
            "steps": self.steps,
            "values": [_encode_all(row) for row in rows],
            "step_width": self.step_width,
        }


@dataclass(frozen=True)
class AbandonedTail:
    """One entry of `GET /runs/{id}/abandoned-steps`: the steps a resume abandoned (recorded
    after `from_step`, the plan's checkpoint, before the run resumed from it)."""

    branch: int
    from_step: int
    step: list[int]
    skipped: list[bool]
    loss: list[float | None]
    loss_scale: list[float | None]
    grad_norm: list[float | None]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AbandonedTail:
        return cls(
            branch=int(data["branch"]),
            from_step=int(data["from_step"]),
            step=[int(s) for s in data["step"]],
            skipped=[bool(s) for s in data["skipped"]],
            loss=_decode_all(data["loss"]),
            loss_scale=_decode_all(data["loss_scale"]),
            grad_norm=_decode_all(data["grad_norm"]),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "branch": self.branch, "from_step": self.from_step, "step": self.step,
            "skipped": self.skipped, "loss": _encode_all(self.loss),
            "loss_scale": _encode_all(self.loss_scale), "grad_norm": _encode_all(self.grad_norm),
        }  # fmt: skip


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


@dataclass(frozen=True)
class LayerSeries:
    """`GET /runs/{id}/layers/{name}/series?stat=...`: one layer's statistic over steps."""

    layer: str
    stat: str
    step: list[int]
    value: list[float | None]
    bucket_width: int = 1

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LayerSeries:
        return cls(
            layer=str(data["layer"]),
            stat=str(data["stat"]),
            step=[int(s) for s in data.get("step", [])],
            value=_decode_all(data.get("value", [])),
            bucket_width=int(data.get("bucket_width") or 1),
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "value": _encode_all(self.value)}


@dataclass(frozen=True)
class LayerHistograms:
    """`GET /runs/{id}/layers/{name}/histograms`: `counts[i][j]` elements of the gradient at
    `steps[i]` have float32 exponent field `offsets[i] + j` (`ampwatch.agent.wire`), the
    gradient scaled by `loss_scale[i]`, the loss scale in effect at that step."""

    layer: str
    steps: list[int]
    offsets: list[int]
    counts: list[list[int]]
    loss_scale: list[float | None] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LayerHistograms:
        steps = [int(s) for s in data.get("steps", [])]
        scales = _decode_all(data.get("loss_scale") or [])
        return cls(
            layer=str(data["layer"]),
            steps=steps,
            offsets=[int(o) for o in data.get("offsets", [])],
            counts=[[int(c) for c in row] for row in data.get("counts", [])],
            # A collector before the field: no scale known.
            loss_scale=scales if len(scales) == len(steps) else [None] * len(steps),
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "loss_scale": _encode_all(self.loss_scale)}

    def scales(self) -> list[float | None]:
        """`loss_scale`, or None per step where it was not given."""
        return (
            self.loss_scale if len(self.loss_scale) == len(self.steps) else [None] * len(self.steps)
        )

    def merged(self, other: LayerHistograms) -> LayerHistograms:
        """Both sets of histograms, ordered by step (`other` wins a step both hold)."""
        by_step = {
            s: (o, c, v)
            for s, o, c, v in zip(self.steps, self.offsets, self.counts, self.scales(), strict=True)
        }
        by_step.update(
            zip(
                other.steps,
                zip(other.offsets, other.counts, other.scales(), strict=True),
                strict=True,
            )
        )
        steps = sorted(by_step)
        return LayerHistograms(
            self.layer,
            steps,
            [by_step[s][0] for s in steps],
            [by_step[s][1] for s in steps],
            [by_step[s][2] for s in steps],
        )


@dataclass(frozen=True)
class Alert:
    """One alert of `GET /runs/{id}/alerts` (the alert engine's contract)."""

    id: int
    rule: str
    layer: str | None
    severity: str
    status: str  # 'pending' | 'firing' | 'resolved'
    started_step: int | None
    fired_step: int | None
    resolved_step: int | None
    started_at: float | None  # Unix seconds, when the collector saw it
    fired_at: float | None
    resolved_at: float | None
    message: str
    values: dict[str, Any]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Alert:
        return cls(
            id=int(data["id"]),
            rule=str(data["rule"]),
            layer=data.get("layer") or None,  # '' (or null) for a run-level rule
            severity=str(data.get("severity") or "warning"),
            status=str(data.get("status") or "firing"),
            started_step=data.get("started_step"),
            fired_step=data.get("fired_step"),
            resolved_step=data.get("resolved_step"),
            started_at=data.get("started_at"),
            fired_at=data.get("fired_at"),
            resolved_at=data.get("resolved_at"),
            message=str(data.get("message") or ""),
            values=dict(data.get("values") or {}),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RestartCandidate:
    """A checkpoint as the restart advisor judged it."""

    step: int | None
    path: str | None
    time: Any
    verdict: str  # 'recommended' | 'healthy' | 'rejected'
    reasons: list[str]
    loss_scale: float | None
    act_norm: float | None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RestartCandidate:
        return cls(
            step=data.get("step"),
            path=data.get("path"),
            time=data.get("time"),
            verdict=str(data.get("verdict") or ""),
            reasons=[str(r) for r in data.get("reasons") or []],
            loss_scale=decode_float(data.get("loss_scale")),
            act_norm=decode_float(data.get("act_norm")),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "loss_scale": encode_float(self.loss_scale),
            "act_norm": encode_float(self.act_norm),
        }


@dataclass(frozen=True)
class RestartAdvice:
    """`GET /runs/{id}/restart-candidates`: the advisor's ranking of the run's checkpoints."""

    onset_step: int | None
    onset_rule: str | None
    margin_steps: int | None
    recommended_step: int | None
    candidates: list[RestartCandidate]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RestartAdvice:
        recommended = data.get("recommended") or {}
        return cls(
            onset_step=data.get("onset_step"),
            onset_rule=data.get("onset_rule"),
            margin_steps=data.get("margin_steps"),
            recommended_step=recommended.get("step"),
            candidates=[RestartCandidate.from_json(c) for c in data.get("candidates") or []],
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "onset_step": self.onset_step,
            "onset_rule": self.onset_rule,
            "margin_steps": self.margin_steps,
            "recommended": None
            if self.recommended_step is None
            else {"step": self.recommended_step},
            "candidates": [c.to_json() for c in self.candidates],
        }


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
