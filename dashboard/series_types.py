"""The step and layer series the collector answers, decoded (`CollectorClient` reads them).

Answers are decoded into small dataclasses whose floats are Python floats, NaN and ±Inf
included (the wire carries them as strings, `ampwatch.agent.wire`). Each dataclass also
turns back into the API's JSON shape (`to_json` / `from_json`): a `dcc.Store` holds that
shape, because Dash's JSON encoder would silently turn NaN into null and the dashboard
must tell "not measured" (null) from "measured NaN".

    >>> series = StepSeries.from_json({"step": [1], "loss": ["NaN"], "loss_scale": [None]})
    >>> series.loss, series.loss_scale, series.to_json()["loss"]
    ([nan], [None], ['NaN'])
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ampwatch.agent.wire import STEP_FLOAT_FIELDS, WireFloat, decode_float, encode_float


def _decode_all(values: list[WireFloat | None]) -> list[float | None]:
    return [decode_float(v) for v in values]


def _encode_all(values: list[float | None]) -> list[WireFloat | None]:
    return [encode_float(v) for v in values]


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
