"""Per-leaf-module activation max-abs: exact against a direct computation in a real FP16
autocast CPU loop with gradient accumulation, stored by a real collector (SQLite and
PostgreSQL) and read back through the layer-matrix and layer-series endpoints."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx
import torch
from torch import nn

from ampwatch.agent import watch
from ampwatch.agent.transport import http_transport

STEPS = 7
EVERY = 3
SAMPLED = [1, 4, 7]
MICRO_BATCHES = 2
MODULES = ["0", "1", "2", "3", "4"]


def test_activation_max_abs_is_exact_and_reaches_the_layer_endpoints(
    db_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")

    # The direct computation: every graph-building forward's max |output| per leaf module,
    # folded over the step's micro-batches by max.
    truth: dict[int, dict[str, float]] = {}
    step = 1

    def direct(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            if torch.is_grad_enabled():
                value = output.detach().abs().max().float().item()
                seen = truth.setdefault(step, {})
                seen[name] = max(seen.get(name, value), value)

        return hook

    for name, module in model.named_children():
        module.register_forward_hook(direct(name))

    bodies: list[bytes] = []
    with start_collector(db_url, dashboard=False) as live:
        send = http_transport(live.url)

        def recording(body: bytes, headers: dict[str, str]) -> int:
            bodies.append(body)
            status: int = send(body, headers)
            return status

        handle = watch(
            model, optimizer, scaler, run_id="acts", transport=recording,
            layer_stats_every=EVERY, activation_max_abs=True, flush_interval=0.05,
            fp8_stats_every=None,
        )  # fmt: skip
        for step in range(1, STEPS + 1):
            for _ in range(MICRO_BATCHES):
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(torch.randn(8, 16) * step)
                    loss = out.float().pow(2).mean() / MICRO_BATCHES
                scaler.scale(loss).backward()
            with torch.no_grad():  # an evaluation forward must not count
                model(torch.randn(8, 16) * 1e4)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        handle.detach(timeout=20)
        assert handle.counters["hook_errors"] == 0

        records = [r for body in bodies for r in json.loads(gzip.decompress(body))["layer_stats"]]
        assert [r["step"] for r in records] == SAMPLED
        for record in records:
            assert record["activations"]["names"] == MODULES
            expected = [truth[record["step"]][name] for name in MODULES]
            assert record["activations"]["max_abs"] == expected  # exact, not approximately
        # Outputs ran in fp16 under autocast: every value is an fp16 number, widened exactly.
        assert all(
            torch.tensor(v).half().float().item() == v
            for r in records
            for v in r["activations"]["max_abs"]
        )

        with httpx.Client(base_url=f"{live.url}/api/v1", timeout=30) as http:
            (run,) = http.get("/runs").json()["runs"]
            matrix = http.get(
                f"/runs/{run['id']}/layers", params={"stat": "activation_max_abs"}
            ).json()
            assert matrix["layers"] == MODULES
            assert matrix["steps"] == SAMPLED
            assert matrix["values"] == [[truth[s][n] for n in MODULES] for s in SAMPLED]
            # Parameter statistics keep their own columns: no module paths among them.
            zero = http.get(f"/runs/{run['id']}/layers", params={"stat": "zero_fraction"}).json()
            assert zero["layers"] == [name for name, _ in model.named_parameters()]
            series = http.get(
                f"/runs/{run['id']}/layers/2/series", params={"stat": "activation_max_abs"}
            ).json()
            assert series["step"] == SAMPLED
            assert series["value"] == [truth[s]["2"] for s in SAMPLED]
            # "2" is a module, not a parameter tensor: unknown to parameter statistics.
            missing = http.get(
                f"/runs/{run['id']}/layers/2/series", params={"stat": "zero_fraction"}
            )
            assert missing.status_code == 404


def test_activation_max_abs_is_off_by_default() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sent: list[dict[str, Any]] = []

    def transport(body: bytes, headers: dict[str, str]) -> int:
        sent.append(json.loads(gzip.decompress(body)))
        return 200

    handle = watch(model, optimizer, transport=transport, layer_stats_every=1)
    assert not any(m._forward_hooks for m in model)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    handle.detach()
    records = [r for batch in sent for r in batch["layer_stats"]]
    assert records and all("activations" not in r for r in records)
