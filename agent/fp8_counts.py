"""FP8 quantisation counts: what a tensor would lose if cast to FP8, under each scaling of
`wire.FP8_SCALINGS` and each format of `wire.FP8_FORMATS` (the arithmetic behind
`ampwatch.agent.fp8`'s readiness samples): on the device, counts and squared errors
(`quantisation_counts`); on the host, the shares they make (`shares`).

Semantics (one home: `quantisation_counts`; the tests check them against torch's own
`float8_e4m3fn` / `float8_e5m2` casts, group by group):

- A tensor is viewed as 2-D (rows = every leading dim, columns = the last: a weight's input
  channels, an activation's channels). `tensor`: one scale. `tile`: 1x128 along a row
  (DeepSeek-V3's activations). `block`: 128x128 (DeepSeek-V3's weights). `mx`: 1x32 along a
  row with an E8M0 (power-of-two) scale 2^e, e the smallest integer with amax <= fmax * 2^e
  (clamped to [-127, 127]): the scale rounded up, as Transformer Engine's MXFP8 quantiser
  does, so nothing saturates; OCP MX's floor(log2 amax) - emax rule would clip the top
  ~0.4% of Gaussian data. A row or column that does not fill its last group makes a smaller
  group (as zero padding would).
- Current scaling (tensor, tile, block): scale s = fmax / amax in float32 (amax of the
  group; s = 1 for an all-zero group), as Transformer Engine's current scaling and
  DeepSeek-V3's `amax / 448` do. y = |x| * s in float32, then a saturating cast.
- flush: x != 0 and the cast of y is 0; saturate: y rounds past fmax (a non-saturating
  cast gives Inf/NaN; the saturating one clips to fmax), which these scalings never let
  happen. Both over all elements (Transformer Engine's `underflows%` divides by numel too). error: ||dequantised - x||_2 / ||x||_2 over the tensor (0 for a zero tensor).
- NaN and +-Inf elements are left out of the scales and of every count and norm (they are
  neither flushed nor saturated, and count as zeros): the scaler skips such a step anyway,
  and one Inf must not make the whole tensor look flushed.
- spread: log2(max group amax / min non-zero group amax), in binary orders of magnitude:
  how far apart the groups' scales are (0 when fewer than one non-zero group).

Cost: no host sync; one call, and one set of launches, for all the tensors of one 2-D
shape (`quantisation_counts`: a call's many small launches cost ~0.5 ms on a CPU, about a
200x333 tensor's arithmetic); one read of each tensor for all eight
combinations (group maxima once, then the eight scaled copies a slice of rows at a time on
reused buffers), the rounding done in float32 arithmetic equal to the casts
(`_round_into`; torch's E4M3 -> float32 decode alone took ~10x as long on a CPU), the
saturate count proven 0 rather than counted (`SATURATE_ABOVE`). `bench/fp8_overhead.py`
measured it (one torch thread): ~17 ns a value for six 200x333 tensors in one call,
against ~20-27 alone; see `ampwatch.agent.fp8.DEFAULT_EVERY`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from ampwatch.agent import wire

#: name -> (torch dtype, largest finite value fmax, E with fmax = 0.875 * 2^E).
FORMATS: dict[str, tuple[torch.dtype, float, int]] = {
    "e4m3": (torch.float8_e4m3fn, 448.0, 9),
    "e5m2": (torch.float8_e5m2, 57344.0, 16),
}
#: y saturates iff it rounds past the largest finite value: above 464 for E4M3 (the tie
#: rounds to even, 448), at or above 61440 for E5M2 (the tie rounds up, to Inf). No element
#: can under these scalings, so the count is 0 without a pass over the tensor: y = |x| * s
#: is monotone in |x|, so a group's largest y is its amax's, and fl(amax * fl(fmax / amax))
#: <= fmax + one float32 ulp (an MX scale is rounded up, so amax * 2^-e <= fmax exactly; a
#: clamped scale, for a tiny amax, is smaller still). The tests check the 0 against the
#: casts on values at and past both formats' limits.
SATURATE_ABOVE: dict[str, float] = {"e4m3": 464.0, "e5m2": 61440.0 - 2.0**-8}
#: name -> (mantissa bits, smallest normal value): what `_rounding_error` rounds to.
ROUNDING: dict[str, tuple[int, float]] = {"e4m3": (3, 2.0**-6), "e5m2": (2, 2.0**-14)}
_EXPONENT_BITS = 0x7F800000  # a float32's exponent field
assert wire.FP8_SCALINGS[-1] == "mx", "group_scales puts the MX scales last"
_MX = len(wire.FP8_SCALINGS) - 1
#: Rows per slice of the eight-combination work: ~this many values of the batch (x 8
#: combinations x 3 float32 buffers = 6 MiB), so a large activation's work memory is
#: bounded. Each of a slice's ~10 passes reads and writes its buffers: at 2^17 values
#: (12 MiB) the linear5 model's sample (`bench/fp8_overhead.py`) took 16.3 ms of CPU, at
#: 2^16 14.0, at 2^15 15.6 (more launches), interleaved, one torch thread.
_CHUNK_VALUES = 1 << 16
#: The most values (of same-shape tensors) one set of launches measures: the magnitudes
#: buffer, 16 MiB of float32, or one tensor's if larger.
_BATCH_VALUES = 1 << 22
#: The largest work buffer a `Workspace` keeps (64 MiB of float32).
_KEEP_VALUES = 1 << 24
TILE = 128
BLOCK = 128
MX_GROUP = 32
_E8M0_MIN, _E8M0_MAX = -127, 127
_F32_MAX = torch.finfo(torch.float32).max

#: Per tensor, the flat layout of the device vector: for each scaling, for each format,
#: (flush count, saturate count, squared error); then ||x||^2; then one spread per
#: grouped scaling (`wire.FP8_SPREAD_SCALINGS`).
_PER_COMBO = 3
_COMBOS = len(wire.FP8_SCALINGS) * len(wire.FP8_FORMATS)
VALUES_PER_TENSOR = _COMBOS * _PER_COMBO + 1 + len(wire.FP8_SPREAD_SCALINGS)


def group_scales(amax: torch.Tensor, workspace: Workspace | None = None) -> torch.Tensor:
    """The multiplier s per group (float32) of every combination: amax [scalings, ...] (one
    per `wire.FP8_SCALINGS`, broadcast to one shape) -> [scalings x formats, ...], in the
    layout's order: fmax / amax for current scaling, 2^-(shared exponent) for MX; 1 for an
    all-zero group. Written into the workspace's `scale` buffer: a batch's scales are
    made once, not per slice of rows (~10 launches a slice), and on kept pages (a fresh
    buffer of this size faulted ~1,100 pages a linear5 sample, more than the launches).

    >>> s = group_scales(torch.tensor([[2.0, 0.0, 600.0]]).expand(4, 3))
    >>> s[-2:]  # MX, E4M3 then E5M2
    tensor([[1.2800e+02, 1.0000e+00, 5.0000e-01],
            [1.6384e+04, 1.0000e+00, 6.4000e+01]])
    >>> group_scales(torch.full((4, 1), 3.6))[-2, 0]  # 3.6 * 128 > 448: rounded up
    tensor(64.)
    """
    workspace = Workspace() if workspace is None else workspace
    shape = (1, len(FORMATS)) + (1,) * (amax.dim() - 1)
    fmax, top = (v.view(shape) for v in _constants(amax.device)[:2])
    out = workspace.take("scale", (amax.shape[0], len(FORMATS), *amax.shape[1:]), amax.device)
    # A true division (`fmax / tensor` with a Python float would multiply by a rounded
    # reciprocal).
    torch.div(fmax, amax[:_MX, None], out=out[:_MX]).clamp_(max=_F32_MAX)
    # Exactly, with amax = m * 2^e (m in [0.5, 1)): amax <= 0.875 * 2^(top + s) iff
    # s >= e - top, plus one when m > 0.875.
    mantissa, exponent = torch.frexp(amax[_MX:, None])
    shared = (exponent - top + (mantissa > 0.875).int()).clamp_(_E8M0_MIN, _E8M0_MAX)
    torch.ldexp(torch.ones((), device=amax.device), -shared, out=out[_MX:])
    return out.masked_fill_((amax <= 0)[:, None], 1.0).flatten(0, 1)


class Workspace:
    """The work buffers of `quantisation_counts`, kept from one tensor and one sample to
    the next on a CPU: a fresh tensor there costs a page fault per 4 KiB on first touch,
    which measured more than the arithmetic. On a GPU the caching allocator already
    reuses memory, and a buffer held between samples would only take it from training.
    Buffers over `_KEEP_VALUES` are not kept."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A float32 tensor of `shape` (contents undefined)."""
        numel = math.prod(shape)
        if device.type != "cpu" or numel > _KEEP_VALUES:
            return torch.empty(shape, device=device)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[name] = torch.empty(numel)
        return buffer[:numel].view(shape)


def batch_key(x: torch.Tensor) -> tuple[int, int, torch.device]:
    """Rows, columns and device of `x` viewed as 2-D (rows = every leading dim, columns =
    the last; a vector is one row): tensors with one key go in one `quantisation_counts`
    call, whatever their dtypes."""
    cols = x.shape[-1] if x.dim() >= 2 else x.numel()
    return x.numel() // max(cols, 1), cols, x.device


def _magnitudes(tensors: Sequence[torch.Tensor], workspace: Workspace) -> torch.Tensor:
    """|x| in float32 as [tensors, rows, columns rounded up to MX_GROUP], NaN/Inf as 0, zero
    padded: the one copy every scaling reads, each tensor written straight into its slice
    (padding is zero, so it moves no count or norm)."""
    rows, cols, device = batch_key(tensors[0])
    if any(batch_key(x) != (rows, cols, device) for x in tensors):
        shapes = [(tuple(x.shape), str(x.device)) for x in tensors]
        raise ValueError(f"one call measures tensors of one 2-D shape and device, got {shapes}")
    a = workspace.take("magnitudes", (len(tensors), rows, cols + -cols % MX_GROUP), device)
    if cols % MX_GROUP:
        a[:, :, cols:] = 0
    for slot, x in zip(a, tensors, strict=True):
        slot[:, :cols] = x.detach().reshape(rows, cols)
    return torch.nan_to_num_(a.abs_(), 0.0, 0.0, 0.0)


def _coarser(amax: torch.Tensor, width: int) -> torch.Tensor:
    """Group maxima of `width` adjacent entries of the last dim (the last group maybe
    narrower): the maxima of the groups they are made of."""
    pad = -amax.shape[-1] % width
    padded = torch.nn.functional.pad(amax, (0, pad)) if pad else amax
    return padded.view(*amax.shape[:-1], -1, width).amax(dim=-1)


def _finer(amax: torch.Tensor, width: int, columns: int) -> torch.Tensor:
    """Each group's value spread back to the `width` entries of the last dim it is made of
    (`columns` of them in all)."""
    return amax.repeat_interleave(width, dim=-1)[..., :columns]


def quantisation_counts(
    tensors: Sequence[torch.Tensor], workspace: Workspace | None = None
) -> torch.Tensor:
    """Launch the FP8 reductions for tensors of one `batch_key`; return their float64 device
    vectors as [tensors, `VALUES_PER_TENSOR`] (layout above), each row exactly what a call
    with that tensor alone gives. Never syncs.

    One call per shape, not per tensor: the launches cost about as much as the arithmetic
    of a 200x333 tensor (a transformer's blocks share a few shapes). At most
    `_BATCH_VALUES` values are measured at once (`_batch_counts`), so the work memory
    stays near one large tensor's.

    >>> v = quantisation_counts([torch.tensor([[1.0, 1e-6, 0.0]])])[0]
    >>> v[0].item(), v[1].item()  # per-tensor E4M3: 1e-6 * 448 < 2^-10 flushes; none saturate
    (1.0, 0.0)
    """
    workspace = Workspace() if workspace is None else workspace
    rows, cols, _ = batch_key(tensors[0])
    step = max(1, _BATCH_VALUES // (rows * (cols + -cols % MX_GROUP)))
    parts = [
        _batch_counts(tensors[start : start + step], workspace)
        for start in range(0, len(tensors), step)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _batch_counts(tensors: Sequence[torch.Tensor], workspace: Workspace) -> torch.Tensor:
    """`quantisation_counts` of a few tensors, in one set of launches.

    One read of each tensor: its magnitudes, once; every scaling's group maxima from the
    1x32 groups' (a 1x128 tile is four of them, a 128x128 block 128 rows of tiles of one
    tensor, the tensor all its blocks); then all eight combinations, per row
    (`_row_sums`); then each tensor's sums over its rows."""
    a = _magnitudes(tensors, workspace)
    batch, rows, cols = a.shape
    groups = a.view(batch, rows, cols // MX_GROUP, MX_GROUP)
    mx_amax = groups.amax(dim=-1)  # [tensors, rows, 1x32 groups]
    width = mx_amax.shape[-1]
    tile_amax = _coarser(mx_amax, TILE // MX_GROUP)  # [tensors, rows, tiles]
    blocks = _coarser(tile_amax.mT, BLOCK).mT  # [tensors, row blocks, tiles]
    top = tile_amax.amax(dim=(1, 2))  # [tensors]
    per_tile = {  # every scaling's amax, spread to each 1x32 group it covers
        "tensor": top[:, None, None].expand_as(mx_amax),
        "tile": _finer(tile_amax, TILE // MX_GROUP, width),
        "block": _finer(_finer(blocks, TILE // MX_GROUP, width).mT, BLOCK, rows).mT,
        "mx": mx_amax,
    }
    amax = torch.stack([per_tile[s] for s in wire.FP8_SCALINGS]).flatten(1, 2)
    # Per tensor, the sums of its rows' (one reduction for all: the same order for any
    # batch): [kept per combination, err^2 per combination, ||x||^2].
    total = _row_sums(groups.flatten(0, 1), amax, workspace).view(-1, batch, rows).sum(dim=-1)
    # x != 0 and q == 0 (one count per tensor: count_nonzero(dim=...) took ~10x as long).
    flushed = torch.stack([t.count_nonzero() for t in a]) - total[:_COMBOS]
    saturated = torch.zeros_like(flushed)  # none can: see SATURATE_ABOVE
    counts = torch.stack([flushed, saturated, total[_COMBOS:-1]], dim=-1)  # [combos, tensors, 3]
    # Spreads: every scaling's largest group amax is the tensor's.
    smallest = {
        name: torch.where(amax > 0, amax, math.inf).amin(dim=(1, 2))
        for name, amax in (("tile", tile_amax), ("block", blocks), ("mx", mx_amax))
    }
    low = torch.stack([smallest[name] for name in wire.FP8_SPREAD_SCALINGS], dim=1)
    spreads = torch.where(top[:, None] > 0, torch.log2(top[:, None] / low), 0.0).double()
    return torch.cat([counts.transpose(0, 1).flatten(1), total[-1:].T, spreads], dim=1)


def _row_sums(groups: torch.Tensor, amax: torch.Tensor, workspace: Workspace) -> torch.Tensor:
    """Per row of `groups` ([rows, 1x32 groups, 32] magnitudes; `amax`: each scaling's,
    [scalings, rows, groups]): float64 [2 x combinations + 1, rows], the count of values
    kept (q != 0) and the squared error per combination, then ||x||^2. All eight
    combinations at once, a slice of rows at a time (the batch's scales, `group_scales`,
    made once): the scaled values, their rounding (`_round_into`), the kept count, and the
    squared error summed per 1x32 group and brought back by that group's 1/s^2. The rest
    is made a slice at a time on the workspace's buffers: a fresh batch-sized tensor
    faults its pages on every call."""
    rows, width = groups.shape[0], groups.shape[1] * MX_GROUP
    step = max(1, _CHUNK_VALUES // width)
    shape = (_COMBOS, min(step, rows), *groups.shape[1:])
    y, q, c = (workspace.take(name, shape, groups.device) for name in ("y", "q", "c"))
    sums = torch.empty(2 * _COMBOS + 1, rows, dtype=torch.float64, device=groups.device)
    scales = group_scales(amax, workspace)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        ys, qs, cs = y[:, :n], q[:, :n], c[:, :n]
        scale = scales[:, start : start + n]
        scale_sq = scale.double().square()  # float64: s^2 overflows float32 for tiny groups
        torch.mul(groups[start : start + n], scale[..., None], out=ys)
        # ||x||^2 from per-tensor E4M3's scaled values (|x|^2 underflows float32).
        rows_y = ys[0].view(n, -1)
        sums[-1, start : start + n] = torch.linalg.vecdot(rows_y, rows_y) / scale_sq[0, :, 0]
        _round_into(qs, cs, ys)
        # Kept: a sum of q's signs (0 or 1; exact in float32 up to 2^24 per row) counts ~5x
        # faster than count_nonzero(dim=...) on a CPU.
        sums[:_COMBOS, start : start + n] = torch.sign(qs, out=cs).sum(dim=(2, 3))
        diff_sq = qs.sub_(ys).square_().sum(dim=-1)  # per 1x32 group, float32
        sums[_COMBOS:-1, start : start + n] = (diff_sq.double() / scale_sq).sum(dim=2)
    return sums


def _round_into(q: torch.Tensor, c: torch.Tensor, y: torch.Tensor) -> None:
    """q = y (>= 0, below the saturation threshold; [combinations, ...]) rounded to each
    combination's format, to nearest-even, in float32 ops on the work buffers q and c,
    without a float8 tensor: y + C - C rounds y to a multiple of C's ulp when
    C = 2^e x 2^(23 - m) (2^e: y's exponent bits, no lower than the format's smallest
    normal, so subnormals round to their fixed step; m: its mantissa bits). C is exact,
    so each addcmul is the one rounding of the add. Equal to torch's saturating casts
    element for element (the tests check); the cast's E4M3 -> float32 decode alone took
    ~10x this on a CPU, and clamping y before masking it one pass more (~20% of this)."""
    shape = (_COMBOS,) + (1,) * (y.dim() - 1)
    _, _, smallest_normal, ulp_shift = _constants(y.device)
    torch.bitwise_and(y.view(torch.int32), _EXPONENT_BITS, out=c.view(torch.int32))
    torch.maximum(c, smallest_normal.view(shape), out=c)  # 2^e (0 for a subnormal y), floored
    torch.addcmul(y, c, ulp_shift.view(shape), out=q).addcmul_(c, ulp_shift.view(shape), value=-1)


@functools.cache
def _constants(device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per format: fmax, E (fmax = 0.875 * 2^E); per combination: the smallest normal
    value, 2^(23 - m) (`_round_into`). Made once per device."""
    fmax = torch.tensor([f[1] for f in FORMATS.values()], device=device)
    top = torch.tensor([f[2] for f in FORMATS.values()], device=device, dtype=torch.int32)
    rounding = [ROUNDING[fmt] for _ in wire.FP8_SCALINGS for fmt in wire.FP8_FORMATS]
    smallest_normal = torch.tensor([r[1] for r in rounding], device=device)
    ulp_shift = torch.tensor([2.0 ** (23 - r[0]) for r in rounding], device=device)
    return fmax, top, smallest_normal, ulp_shift


def shares(values: Sequence[float], numel: int) -> dict[str, float]:
    """Host side: one tensor's `quantisation_counts` -> {"{fmt}_{scaling}_{metric}": v,
    "{scaling}_spread": v}, the suffixes of `wire.fp8_stat` names.

    >>> s = shares([0.0] * 24 + [0.0, 0.0, 0.0, 0.0], 4)
    >>> s["e4m3_tensor_flush"], s["e4m3_tensor_error"], s["tile_spread"]
    (0.0, 0.0, 0.0)
    """
    out: dict[str, float] = {}
    norm_sq = values[_COMBOS * _PER_COMBO]
    i = 0
    for scaling in wire.FP8_SCALINGS:
        for fmt in wire.FP8_FORMATS:
            flush, saturate, err_sq = values[i : i + _PER_COMBO]
            i += _PER_COMBO
            out[f"{fmt}_{scaling}_flush"] = flush / numel
            out[f"{fmt}_{scaling}_saturate"] = saturate / numel
            out[f"{fmt}_{scaling}_error"] = math.sqrt(err_sq / norm_sq) if norm_sq > 0 else 0.0
    for j, scaling in enumerate(wire.FP8_SPREAD_SCALINGS):
        out[f"{scaling}_spread"] = values[_COMBOS * _PER_COMBO + 1 + j]
    return out
