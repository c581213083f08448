"""FP8 counts of same-shape tensors in one call: each tensor's row equals, value for value,
what a call with that tensor alone gives (tensor amax per tensor, 128x128 blocks never
across tensors, per-tensor sums and spreads), whatever the batch, the slicing of rows or
the split into sub-batches; and the monitor makes one call per shape, results in order."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ampwatch.agent import fp8, fp8_counts
from ampwatch.agent.fp8 import Fp8Monitor
from ampwatch.agent.fp8_counts import Workspace, batch_key, quantisation_counts


def _alone(tensors: list[torch.Tensor]) -> list[list[float]]:
    workspace = Workspace()
    return [quantisation_counts([x], workspace)[0].tolist() for x in tensors]


def _batch(rows: int, cols: int, seed: int) -> list[torch.Tensor]:
    """One shape's tensors: wide Gaussian, NaN/Inf, all zero, tiny, huge, near float32's
    max, an FP16 one (dtypes may mix)."""
    generator = torch.Generator().manual_seed(seed)

    def gaussian(scale: float = 1.0) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) * scale

    wide = gaussian() * torch.exp2(torch.randint(-60, 20, (rows, cols), generator=generator))
    special = gaussian()
    special.view(-1)[:: max(1, special.numel() // 3)] = math.nan
    special.view(-1)[1::5] = math.inf
    special.view(-1)[-1] = -math.inf
    return [
        wide,
        special,
        torch.zeros(rows, cols),
        gaussian(1e-39),
        gaussian(1e6),
        gaussian(1e37).clamp(-3.4e38, 3.4e38),
        gaussian(100).half(),
        gaussian(0.02),
    ]


#: Rows not a multiple of 128 (and past a block), columns not a multiple of 32, a vector,
#: a 3-D activation.
SHAPES = [(130, 257), (128, 128), (3, 300), (1, 1000), (257, 40), (200, 333)]


@pytest.mark.parametrize("shape", SHAPES)
def test_a_batch_gives_each_tensor_what_it_gives_alone(shape: tuple[int, int]) -> None:
    tensors = _batch(*shape, seed=shape[0])
    batched = quantisation_counts(tensors, Workspace())
    assert batched.shape == (len(tensors), fp8_counts.VALUES_PER_TENSOR)
    assert batched.tolist() == _alone(tensors)


def test_slices_and_sub_batches_that_cross_tensors_change_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Slices of 3 rows (a tensor's rows split, slices spanning two tensors) and
    sub-batches of 3 tensors give the values of whole tensors measured alone."""
    tensors = [*_batch(130, 257, seed=3), torch.randn(2, 65, 257)]
    alone = _alone(tensors)
    monkeypatch.setattr(fp8_counts, "_CHUNK_VALUES", 3 * 288)
    monkeypatch.setattr(fp8_counts, "_BATCH_VALUES", 3 * 130 * 288)
    assert quantisation_counts(tensors, Workspace()).tolist() == alone


def test_one_call_takes_one_shape_and_device() -> None:
    assert batch_key(torch.zeros(2, 3, 40)) == batch_key(torch.zeros(6, 40).half())
    assert batch_key(torch.zeros(7)) == (1, 7, torch.device("cpu"))
    with pytest.raises(ValueError, match="one 2-D shape"):
        quantisation_counts([torch.zeros(4, 40), torch.zeros(40, 4)])


_VALUES = st.sampled_from([0.0, 1.0, -3.5, 448.0, 1e-6, 1e-40, 6e4, 3e38, math.nan, math.inf])


@st.composite
def _same_shape(draw: st.DrawFn) -> list[torch.Tensor]:
    rows, cols = draw(st.integers(1, 260)), draw(st.integers(1, 70))
    out = []
    for _ in range(draw(st.integers(1, 4))):
        seed = draw(st.integers(0, 2**31 - 1))
        generator = torch.Generator().manual_seed(seed)
        exponent = torch.randint(-140, 120, (rows, cols), generator=generator).float()
        x = torch.randn(rows, cols, generator=generator) * torch.exp2(exponent)
        for value in draw(st.lists(_VALUES, max_size=6)):
            x.view(-1)[draw(st.integers(0, x.numel() - 1))] = value
        out.append(x)
    return out


@settings(max_examples=25, deadline=None)
@given(_same_shape())
def test_any_batch_equals_its_tensors_alone(tensors: list[torch.Tensor]) -> None:
    assert quantisation_counts(tensors, Workspace()).tolist() == _alone(tensors)


def test_the_monitor_makes_one_call_per_shape_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing copied for the sender (`_COPY_BYTES` 0, as on a GPU): the weights and
    gradients of five Linears (two shapes) in two calls at the end of the sample, each
    activation at once; every tensor's vector where it was, equal to its own call's."""
    torch.manual_seed(0)
    widths = [33, 20, 33, 20, 33, 20]
    model = nn.Sequential(*[nn.Linear(widths[i], widths[i + 1]) for i in range(5)])
    monkeypatch.setattr(fp8, "_COPY_BYTES", 0)
    calls: list[int] = []

    def counting(tensors: list[torch.Tensor], workspace: Workspace | None = None) -> torch.Tensor:
        calls.append(len(tensors))
        return quantisation_counts(tensors, workspace)

    monkeypatch.setattr(fp8, "quantisation_counts", counting)
    monitor = Fp8Monitor(model, every=1, on_error=pytest.fail, to_host=lambda t: (t, None))
    model(torch.randn(4, 33)).pow(2).mean().backward()
    calls.clear()  # the activations' (one each, in the forward)
    sample = monitor.after_step(1)
    assert sample is not None and sample.values is not None
    assert sorted(calls) == [4, 6]
    layers = [model[i] for i in range(5)]
    tensors = [m.weight for m in layers] + [m.weight.grad for m in layers]
    vectors = sample.values.view(-1, fp8_counts.VALUES_PER_TENSOR)[: len(tensors)]
    assert vectors.tolist() == _alone([t.detach() for t in tensors])
