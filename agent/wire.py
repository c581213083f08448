"""The wire format between the agent and the collector: one versioned place both sides use.

The agent builds batches with these helpers (standard library only, so training images need
nothing but torch); the collector validates them with pydantic models in
`ampwatch.server.schemas.wire` whose field names and limits come from the constants here, and
the tests send agent-built batches through those models.

A batch, as JSON (`WIRE_VERSION` 1)::

    {
      "wire_version": 1,
      "run": {"client_run_id": "3f2a...", "name": "gpt-small", "project": "default"},
      "stream": "9c1e...",            # the sending process's id (uuid4 hex); see STREAM_*
      "seq": 0,                       # per stream, from 0, increasing; a gap is a rejected batch
      "steps": [                      # one record per optimizer step
        {"step": 1, "loss": 2.31, "loss_scale": 65536.0, "skipped": false,
         "grad_norm": null, "lr": 0.001, "act_norm_mean": 7.9, "act_norm_max": 11.2,
         "rank": 0,
         "lr_groups": [0.001, 0.0001],  # optional: only with more than one param group
         "grad_norm_clipped": 1.0,      # optional: only when the loop clipped (see below)
         "grad_sumsq": 0.42, "grad_parts": 8}  # optional: sharded, unclipped (see below)
      ],
      "layer_stats": [                # sampled every N steps; arrays aligned with names
        {"step": 10, "rank": 0, "names": ["fc1.weight", "fc1.bias"],
         "stats": {"zero_fraction": [0.0, 0.25], "flush_fraction": [0.01, 0.0], ...},
         "exponent_histograms": {      # optional; see EXPONENT_HISTOGRAM below
           "offsets": [100, 98], "counts": [[3, 0, 17, ...], [1, 2, ...]]},
         "activations": {              # optional; see ACTIVATION_STATS below
           "names": ["fc1", "act", "fc2"], "max_abs": [31.5, 12.0, 870.0]}}
      ],
      "events": [
        {"kind": "run_start", "step": null, "time": 1732870000.0, "data": {...}}
      ],
      "dropped": {"steps": 0, "layer_stats": 0, "events": 0}
    }

JSON has no literal for NaN and ±Inf, yet they are exactly the values the runs we watch
produce. Every float field therefore carries either a JSON number or one of the strings
``"NaN"``, ``"Infinity"``, ``"-Infinity"``. This module is that convention's one home:
the agent encodes with it, the collector validates, stores and answers with it, the
dashboard decodes with it (`encode_float` / `decode_float`, the lists' and free-form data's
variants, and the three strings for vectorised code).
"""

from __future__ import annotations

import json
import math
from typing import Any, Final, Literal, TypedDict

WIRE_VERSION: Final = 1
#: Where the collector serves its HTTP API and mounts the dashboard: one spelling for the
#: collector, the dashboard's client, the agent and the CLI.
API_PREFIX: Final = "/api/v1"
DASHBOARD_PREFIX: Final = "/dashboard"
INGEST_PATH: Final = f"{API_PREFIX}/ingest"

#: The wire's spellings of the non-finite floats.
NAN: Final = "NaN"
INFINITY: Final = "Infinity"
NEG_INFINITY: Final = "-Infinity"
NON_FINITE: Final[dict[str, float]] = {
    NAN: math.nan,
    INFINITY: math.inf,
    NEG_INFINITY: -math.inf,
}

#: Per-parameter-tensor statistics a layer-stats record may carry (name -> array), all
#: over the tensor's gradient elements g, with S the loss scale in effect for the step
#: (1 without a scaler):
#:   zero_fraction       share with g == 0 exactly
#:   subnormal_fraction  share with 2^-24 <= |g*S| < 2^-14 (FP16's subnormal range)
#:   flush_fraction      share with 0 < |g*S| < 2^-24: would flush to zero in FP16 at this
#:                       scale (an underflow forecast even when grads live in FP32)
#:   max_abs_scaled      max |g*S|, to compare with FP16_MAX (overflow headroom)
LAYER_STATS: Final = ("zero_fraction", "subnormal_fraction", "flush_fraction", "max_abs_scaled")

#: FP8 readiness (`ampwatch.agent.fp8` defines each measure), per nn.Linear, named by its
#: weight parameter, every role in its own record: `fp8_{role}_{fmt}_{scaling}_{metric}`
#: with metric flush (share that would round to 0), saturate (share beyond the format's
#: max, clipped) or error (relative L2 quantisation error), and `fp8_{role}_{scaling}_spread`
#: (log2 of max / min non-zero group amax). Roles: the weight, its gradient, the layer's
#: input activation.
FP8_ROLES: Final = ("weight", "grad", "act")
FP8_FORMATS: Final = ("e4m3", "e5m2")
#: per-tensor, 1x128 tiles (rows), 128x128 blocks, MX 1x32 with power-of-two (E8M0) scales.
FP8_SCALINGS: Final = ("tensor", "tile", "block", "mx")
FP8_SPREAD_SCALINGS: Final = ("tile", "block", "mx")
FP8_METRICS: Final = ("flush", "saturate", "error")


def fp8_stat(role: str, fmt: str, scaling: str, metric: str) -> str:
    """The layer statistic's name.

    >>> fp8_stat("grad", "e4m3", "tile", "flush")
    'fp8_grad_e4m3_tile_flush'
    """
    return f"fp8_{role}_{fmt}_{scaling}_{metric}"


def fp8_spread_stat(role: str, scaling: str) -> str:
    return f"fp8_{role}_{scaling}_spread"


FP8_STATS: Final = tuple(
    fp8_stat(r, f, s, m)
    for r in FP8_ROLES
    for f in FP8_FORMATS
    for s in FP8_SCALINGS
    for m in FP8_METRICS
) + tuple(fp8_spread_stat(r, s) for r in FP8_ROLES for s in FP8_SPREAD_SCALINGS)

#: FP8 recipes a run may declare (`watch(fp8_recipe=...)`, sent in run_start) and the
#: readiness view judges: role -> (format, scaling).
#:   per_tensor  current per-tensor scaling, E4M3 forward / E5M2 gradients (TE's HYBRID)
#:   tile_1x128  1x128 tiles on every tensor, E4M3 throughout (row-wise scaling)
#:   blockwise   DeepSeek-V3: 128x128 weight blocks, 1x128 tiles elsewhere, E4M3 throughout
#:   mxfp8       MX 1x32 blocks with E8M0 scales, E4M3 throughout (TE's MXFP8 default)
FP8_RECIPES: Final[dict[str, dict[str, tuple[str, str]]]] = {
    "per_tensor": {"weight": ("e4m3", "tensor"), "act": ("e4m3", "tensor"),
                   "grad": ("e5m2", "tensor")},
    "tile_1x128": {"weight": ("e4m3", "tile"), "act": ("e4m3", "tile"), "grad": ("e4m3", "tile")},
    "blockwise": {"weight": ("e4m3", "block"), "act": ("e4m3", "tile"),
                  "grad": ("e4m3", "tile")},
    "mxfp8": {"weight": ("e4m3", "mx"), "act": ("e4m3", "mx"), "grad": ("e4m3", "mx")},
}  # fmt: skip

#: Every per-parameter statistic the collector stores (packed by layer).
PARAMETER_STATS: Final = (*LAYER_STATS, *FP8_STATS)

FP16_MAX: Final = 65504.0
FP16_MIN_NORMAL: Final = 2.0**-14
FP16_MIN_SUBNORMAL: Final = 2.0**-24

#: Exponent histograms of the unscaled gradient, one per parameter tensor, binned by the
#: float32 biased exponent field e of each element: counts[i][j] is the number of elements
#: of tensor i whose field equals offsets[i] + j. Field 0 holds zeros and float32
#: subnormals, 255 holds Inf and NaN, and 1..254 holds |g| in [2^(e-127), 2^(e-126)).
#: Only the non-empty span is sent. One pass yields every statistic above at any scale S
#: (shift the bins by log2 S), so the dashboard can draw the FP8/FP16/BF16 ranges against it.
EXPONENT_HISTOGRAM_BINS: Final = 256
EXPONENT_BIAS: Final = 127

#: Per-module statistics a layer-stats record's optional "activations" may carry, aligned
#: with its own "names": leaf module paths (`named_modules()`; "(model)" for a model that
#: is its own only leaf), not parameter names, so they are a separate list.
#:   activation_max_abs  max |output| over the step's graph-building forwards, in fp32, to
#:                       compare with FP16_MAX (or FP8's 448 / 57344): overflow headroom
ACTIVATION_STATS: Final = ("activation_max_abs",)

#: Event kinds the collector understands. `data_position`: {epoch, batch, stride}, the first
#: batch of the event's step (`ampwatch.agent.data_position`); `resumed`: a process resumed
#: from a resume plan (`ampwatch.agent.resume`). A collector older than a kind refuses the
#: batch (422): the agent sends these two only when the loop asks for them. `finding`:
#: {"code", "message", ...details}; the codes that raise a rule are the collector's
#: (`alerts.rules.FINDING_RULES`), the others are shown as events.
EVENT_KINDS: Final = ("run_start", "checkpoint", "run_end", "finding", "data_position", "resumed")

#: `run_start`'s key for the loss scaler's configured floor (`watch(min_loss_scale=...)`;
#: fairseq, DeepSpeed and Megatron `min_loss_scale`): a positive number, or null where the
#: scaler has none (torch's GradScaler) or the agent does not know it. The scale rules judge
#: a low scale against it when it is there.
MIN_LOSS_SCALE: Final = "min_loss_scale"

#: `run_start`'s key saying the process's loss scaler already has a history when its first
#: step arrives (an imported log excerpt that starts mid-run, a scaler restored from a
#: checkpoint): true means its first skips are not warm-up calibration. Absent or false: the
#: collector judges warm-up from the process's first steps (`rule_settings.LossScaleCollapse`).
SCALER_CALIBRATED: Final = "scaler_calibrated"

#: Keys of a batch's "dropped" field: records the agent dropped (never blocking training)
#: since its previous batch was acknowledged.
DROPPED_KINDS: Final = ("steps", "layer_stats", "events")

#: Step-record float fields that may be null (not measured) or non-finite.
#: `grad_norm` is the unscaled total L2 norm of the step's gradients; when the loop clipped
#: them (`clip_grad_norm_`), the norm before clipping, what the clip returned, and
#: `grad_norm_clipped` the norm after it (optional in a record: absent means not clipped
#: or not known, as null does). `act_norm_*` is the final hidden state as the head reads it,
#: after the final norm, which caps it; `act_prenorm_*` the same norm of the final norm's
#: input, the last block's output, where a divergence shows (optional: absent when the
#: model has no final norm or `final_layer` names the module). `adam_rms_max` and
#: `update_ratio_max` are the maxima over layers of Adam's second-moment lag
#: sqrt(mean(g**2 / v_hat)) and of ||update|| / ||weight||, read from an Adam-family
#: optimizer's state every step (`ampwatch.agent.precursors`; optional: absent without one).
STEP_FLOAT_FIELDS: Final = (
    "loss",
    "loss_scale",
    "grad_norm",
    "lr",
    "act_norm_mean",
    "act_norm_max",
    "grad_norm_clipped",
    "act_prenorm_mean",
    "act_prenorm_max",
    "adam_rms_max",
    "update_ratio_max",
)
#: The optional step fields read from the optimizer's state (`ampwatch.agent.precursors`).
PRECURSOR_FIELDS: Final = ("adam_rms_max", "update_ratio_max")

#: A sharded run's step records without a clip (FSDP2, FSDP1) carry, from every rank, its
#: part of the global grad norm: `grad_sumsq`, the unscaled sum of squares of the rank's
#: local gradient shards (a shard replicated on k ranks counted 1/k), and `grad_parts`, the
#: number of ranks whose parts make the whole (the world size). The collector stores
#: `grad_norm` = sqrt(sum of the parts) on the lowest rank's row once all parts of the
#: step arrived; a non-finite part (an overflow step) makes it non-finite. Not a
#: `STEP_FLOAT_FIELDS` member: no series or rollup of its own.
MAX_GRAD_PARTS: Final = 1 << 20

#: A step record's optional `lr_groups`: the lr of every param group of every watched
#: optimizer, in order (`lr` is the first of them), sent only when there is more than one:
#: layer-wise lr, or no-decay groups with their own schedule, are invisible in `lr` alone.
MAX_LR_GROUPS: Final = 1024

MAX_NAME_LENGTH: Final = 512

#: A batch's `stream`: the id one `Sender` draws at construction, so that `seq` is
#: numbered per sending process. Every rank of a distributed run shares the run id, and a
#: run resumed from a checkpoint reuses it, each numbering seq from 0; the collector's
#: idempotency key is therefore (run, stream, seq), never (run, seq).
STREAM_MAX_LENGTH: Final = 64
STREAM_PATTERN: Final = r"^[0-9a-f-]+$"

WireFloat = float | Literal["NaN", "Infinity", "-Infinity"]


class _RunRefRequired(TypedDict):
    client_run_id: str
    name: str


class RunRef(_RunRefRequired, total=False):
    #: Absent: the collector files the run under the token's project ("default" without one).
    project: str


class _StepRecordRequired(TypedDict):
    step: int
    loss: WireFloat | None
    loss_scale: WireFloat | None
    skipped: bool
    grad_norm: WireFloat | None
    lr: WireFloat | None
    act_norm_mean: WireFloat | None
    act_norm_max: WireFloat | None
    rank: int


class StepRecord(_StepRecordRequired, total=False):
    lr_groups: list[WireFloat]
    grad_norm_clipped: WireFloat | None
    grad_sumsq: WireFloat
    grad_parts: int
    act_prenorm_mean: WireFloat | None
    act_prenorm_max: WireFloat | None
    adam_rms_max: WireFloat | None
    update_ratio_max: WireFloat | None


class ExponentHistograms(TypedDict):
    offsets: list[int]
    counts: list[list[int]]


class _LayerStatsRequired(TypedDict):
    step: int
    rank: int
    names: list[str]
    stats: dict[str, list[WireFloat]]


class ActivationStats(TypedDict):
    names: list[str]
    max_abs: list[WireFloat]


class LayerStatsRecord(_LayerStatsRequired, total=False):
    exponent_histograms: ExponentHistograms
    activations: ActivationStats


class EventRecord(TypedDict):
    kind: str
    step: int | None
    time: float
    data: dict[str, Any]


class Batch(TypedDict):
    wire_version: int
    run: RunRef
    stream: str
    seq: int
    steps: list[StepRecord]
    layer_stats: list[LayerStatsRecord]
    events: list[EventRecord]
    dropped: dict[str, int]


def encode_float(value: float | None) -> WireFloat | None:
    """Return `value` as JSON can carry it: a number, a non-finite marker string, or None.

    >>> encode_float(float("inf"))
    'Infinity'
    """
    if value is None:
        return None
    if math.isfinite(value):
        return float(value)
    if math.isnan(value):
        return NAN
    return INFINITY if value > 0 else NEG_INFINITY


def decode_float(value: WireFloat | None) -> float | None:
    """Inverse of `encode_float`; raises ValueError on any other string.

    >>> decode_float("-Infinity")
    -inf
    """
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return NON_FINITE[value]
        except KeyError:
            raise ValueError(
                f"{value!r} is not a number; non-finite floats are written "
                f"as one of {sorted(NON_FINITE)}"
            ) from None
    return float(value)


def encode_floats(values: list[float]) -> list[WireFloat]:
    """`encode_float` over a list, fast when every value is finite (the common case)."""
    if all(math.isfinite(v) for v in values):
        return [float(v) for v in values]
    return [encode_float(v) for v in values]  # type: ignore[misc]


def encode_nested(value: Any) -> Any:
    """JSON-like `value` (an event's free-form data) with every non-finite float encoded,
    at any depth, so that it serialises as strict JSON.

    >>> encode_nested({"loss": [1.0, float("nan")], "step": 3})
    {'loss': [1.0, 'NaN'], 'step': 3}
    """
    if isinstance(value, float) and not math.isfinite(value):
        return encode_float(value)
    if isinstance(value, dict):
        return {key: encode_nested(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_nested(item) for item in value]
    return value


def dumps(value: Any) -> str:
    """`value` as strict JSON, every non-finite float in the wire's spelling at any depth:
    how the collector writes every JSON column (alert values and state, event data, rule
    settings), so that one spelling holds on every backend -- PostgreSQL's json refuses
    the bare NaN/Infinity that `json.dumps` writes by default, which SQLite kept.
    Fast when every float is finite (the common case): one C-level pass.

    >>> dumps({"ratio": float("inf"), "step": 3})
    '{"ratio": "Infinity", "step": 3}'
    """
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:  # a non-finite float somewhere
        return json.dumps(encode_nested(value), allow_nan=False)
