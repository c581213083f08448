"""FP8 readiness and loss-scale advice, end to end: a real agent in a real CPU training loop,
a real collector (SQLite and PostgreSQL) and the `/fp8-readiness` and `/loss-scale-advice`
routes, checked against direct computations on the same tensors."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx
import torch
from fp8_scenario import SAMPLED, train_outlier_run
from torch import nn

from ampwatch.agent import watch, wire
from ampwatch.agent.transport import http_transport


def test_outlier_channels_need_finer_scaling_and_a_plain_layer_fits_every_recipe(
    db_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> None:
    with start_collector(db_url, dashboard=False) as live:
        train_outlier_run(live.url)
        with httpx.Client(base_url=f"{live.url}/api/v1", timeout=30) as http:
            (run,) = http.get("/runs").json()["runs"]
            answer = http.get(f"/runs/{run['id']}/fp8-readiness").json()
            advice = http.get(f"/runs/{run['id']}/loss-scale-advice").json()
            alerts = http.get(f"/runs/{run['id']}/alerts").json()["alerts"]

    assert answer["step"] == 7 and answer["steps"] == SAMPLED
    assert answer["declared_recipe"] == "per_tensor"
    assert answer["summary"] == {"fits": 1, "needs_finer_scaling": 1, "keep_bf16": 0}
    worst, plain = answer["layers"]
    assert worst["layer"] == "2.weight" and worst["verdict"] == "needs_finer_scaling"
    weight = worst["measures"]["weight"]
    assert weight["e4m3_tensor"]["flush"] > 0.9  # per-tensor: most of the layer flushes
    assert weight["e4m3_tile"]["flush"] == 0.0  # 1x128 tiles: nothing does
    assert (
        worst["recipes"]["per_tensor"]["roles"]["weight"]["flush"] == weight["e4m3_tensor"]["flush"]
    )
    assert worst["spread"]["weight"]["tile"] > 20  # the tiles' scales span 2^22
    assert set(worst["fits_with"]) == {"tile_1x128", "mxfp8"}  # 128x128 blocks hold outliers
    assert worst["reason"].startswith("per-tensor E4M3: weight flush 9")
    assert worst["trend"]["per_tensor"][0] > 1 and worst["stopped_fitting"]["tile_1x128"] is None
    # Its input activation (ReLU of layer 0) is ordinary: the weight is what fails.
    assert worst["recipes"]["per_tensor"]["roles"]["act"]["score"] <= 1

    assert plain["layer"] == "0.weight" and plain["verdict"] == "fits"
    assert set(plain["fits_with"]) == set(wire.FP8_RECIPES)
    assert set(plain["recipes"]["per_tensor"]["roles"]) == {"weight", "grad", "act"}
    assert all(p <= 1 for series in plain["trend"].values() for p in series)
    assert plain["reason"].startswith("fits every limit")

    # The run declares per-tensor scaling: fp8_risk fires for the outlier layer at its 2nd
    # FP8 sample (step 4), with the view's own numbers, and not for the layer that fits.
    (alert,) = alerts
    assert (alert["rule"], alert["layer"], alert["status"]) == ("fp8_risk", "2.weight", "firing")
    assert (alert["started_step"], alert["fired_step"]) == (1, 4)
    assert alert["values"]["recipe"] == "per_tensor" and alert["values"]["value"] > 0.9
    assert "its weight (E4M3, per-tensor)" in alert["message"]

    # An FP32 run without a scaler: the advice says it does not apply, and why.
    assert advice["applies"] is False and "not FP16" in advice["why"]


def _fields(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """Smallest and largest float32 exponent field over non-zero finite elements."""
    fields = torch.cat([
        t.float().flatten().view(torch.int32).bitwise_right_shift(23).bitwise_and(0xFF)
        for t in tensors
    ])  # fmt: skip
    fields = fields[(fields > 0) & (fields < 255)]
    return int(fields.min()), int(fields.max())


def test_loss_scale_advice_is_the_exact_clean_range_of_the_histograms(
    sqlite_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    sampled: list[torch.Tensor] = []
    with start_collector(sqlite_url, dashboard=False) as live:
        with watch(model, optimizer, scaler, transport=http_transport(live.url),
                   layer_stats_every=2, flush_interval=0.05):  # fmt: skip
            for step in range(1, 6):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(8, 16) * step).float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(optimizer)  # unscales: the agent's histograms see these grads
                if step % 2 == 1:
                    sampled += [p.grad.clone() for p in model.parameters()]
                scaler.update()
                optimizer.zero_grad()
        with httpx.Client(base_url=f"{live.url}/api/v1", timeout=30) as http:
            (run,) = http.get("/runs").json()["runs"]
            advice = http.get(f"/runs/{run['id']}/loss-scale-advice").json()
            bad = [
                http.get(f"/runs/{run['id']}/loss-scale-advice", params={"max_steps": 1}),
                http.get(f"/runs/{run['id']}/fp8-readiness", params={"max_flush": 2}),
                http.get(f"/runs/{run['id']}/fp8-readiness", params={"max_error_e4m3": "nan"}),
                http.get("/runs/999/fp8-readiness"),
            ]
            empty = http.get(f"/runs/{run['id']}/fp8-readiness", params={"rank": 3}).json()

    low, high = _fields(sampled)
    k_low, k_high = 103 - low, 141 - high  # no bin below 2^-24, none reaching 2^16
    peak = max(float(t.abs().max()) for t in sampled)
    while peak * 2.0 ** (k_high + 1) <= wire.FP16_MAX:  # the top bin's max fits once more
        k_high += 1
    assert advice["applies"] is True and advice["steps_read"] == 3
    assert advice["safe_range"] == [k_low, k_high]
    assert advice["init_scale"] == 2.0**k_high
    assert advice["growth_interval"] == (2000 if k_high - k_low >= 4 else 10000)
    assert advice["reason"].startswith(f"with S = 2^{k_high}: 0.0% flush, 0.0% overflow")
    rows = {row["exponent"]: row for row in advice["table"]}
    assert rows[k_low - 1]["flush"] > 0 and rows[k_low]["flush"] == 0
    assert rows[k_high + 1]["overflow"] > 0 and rows[k_high]["overflow"] == 0
    assert [r.status_code for r in bad] == [422, 422, 422, 404]
    assert empty["step"] is None and empty["layers"] == []


class FixedGradient(nn.Module):
    """One parameter whose gradient is exactly `values` (d/dw of w . values)."""

    def __init__(self, values: list[float]) -> None:
        super().__init__()
        self.values = torch.tensor(values)
        self.weight = nn.Parameter(torch.zeros(len(values)))

    def forward(self) -> torch.Tensor:
        return (self.weight * self.values).sum()


def _next32(value: float, toward: float) -> float:
    """The float32 next to `value` toward `toward`."""
    return torch.nextafter(torch.tensor(value), torch.tensor(toward)).item()


EDGE_CASES = {
    # name: (gradient values, the true clean range: no |g S| < 2^-24, none > 65504)
    "up-to-12": ([12.0, 1.0, 2.0**-31], (7, 12)),  # bins alone said [7, 11]
    "top-exactly-65504": ([65504 / 2**12, 2.0**-10], (-14, 12)),
    "top-just-above": ([_next32(65504 / 2**12, 99.0), 2.0**-10], (-14, 11)),
    "top-16-low-just-below-a-bin": ([16.0, _next32(2.0**-10, 0.0)], (-13, 11)),
}


def test_loss_scale_advice_is_exact_at_the_bin_edges_on_both_ends(
    sqlite_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> None:
    """Gradients set exactly at and next to the edges: 2^-24 / S (the flush edge, a bin
    boundary) and 65504 / S (the overflow edge, inside a bin). Truth: the definitions,
    checked here by brute force over k."""
    with start_collector(sqlite_url, dashboard=False) as live:
        for name, (values, _) in EDGE_CASES.items():
            model = FixedGradient(values)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
            with watch(model, optimizer, scaler, transport=http_transport(live.url), run=name,
                       layer_stats_every=1, flush_interval=0.05, fp8_stats_every=None):  # fmt: skip
                scaler.scale(model()).backward()
                assert model.weight.grad is not None
                scaler.step(optimizer)
                assert model.weight.grad.tolist() == values  # unscaled exactly
                scaler.update()
        with httpx.Client(base_url=f"{live.url}/api/v1", timeout=30) as http:
            runs = {r["name"]: r["id"] for r in http.get("/runs").json()["runs"]}
            advice = {n: http.get(f"/runs/{runs[n]}/loss-scale-advice").json() for n in EDGE_CASES}
    for name, (values, expected) in EDGE_CASES.items():
        clean = [
            k for k in range(-40, 40)
            if all(2.0**-24 <= abs(v) * 2.0**k <= wire.FP16_MAX for v in values)
        ]  # fmt: skip
        assert (clean[0], clean[-1]) == expected, name  # the cases say what they test
        assert advice[name]["safe_range"] == list(expected), name
        rows = {row["exponent"]: row for row in advice[name]["table"]}
        low, high = expected
        assert rows[low]["flush"] == 0 < rows[low - 1]["flush"], name
        assert rows[high]["overflow"] == 0 < rows[high + 1]["overflow"], name
