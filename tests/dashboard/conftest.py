"""API-shaped data for dashboard tests: what the collector's v1 read API answers."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

RUN_ID = 7  # the one run the fake collector knows


@pytest.fixture
def run_json() -> dict[str, Any]:
    return {
        "id": RUN_ID,
        "client_run_id": "3f2a",
        "name": "gpt-small",
        "project": "default",
        "status": "running",
        "created_at": "2026-11-29T09:00:00+00:00",
        "last_seen_at": "2026-11-29T09:30:05.123456+00:00",
        "steps": 6,
        "last_step": 6,
        "last_loss_scale": 16384.0,
        "skipped_steps": 2,
    }


@pytest.fixture
def steps_json() -> dict[str, Any]:
    """Six steps: skips at 3 and 5 (the scale halves after each), a NaN loss at 5."""
    return {
        "step": [1, 2, 3, 4, 5, 6],
        "loss": [2.5, 2.4, "Infinity", 2.2, "NaN", 2.0],
        "loss_scale": [65536.0, 65536.0, 65536.0, 32768.0, 32768.0, 16384.0],
        "skipped": [False, False, True, False, True, False],
        "grad_norm": [1.0, 0.9, None, 0.8, None, 0.7],
        "lr": [1e-3] * 6,
        "act_norm_mean": [7.9, 8.0, 8.1, "Infinity", 8.3, 8.4],
        "act_norm_max": [11.2, 11.0, 12.5, 13.0, 40.0, 12.0],
        # activation_norm_spike judged steps 3-6 (the ring was short before); 5 spiked.
        "act_threshold": [None, None, 16.2, 16.0, 16.4, 16.6],
        "act_above_count": [0, 0, 0, 0, 1, 0],
        "rule_lines": {
            "activation": {
                "field": "act_norm_max",
                "enabled": True,
                "min_ratio": 2.0,
                "z_threshold": 10.0,
                "baseline_steps": 128,
                "min_baseline_steps": 2,
            },
            "loss_scale": {
                "min_scale": 1.0,
                "scaler_floor": None,
                "floor_headroom_octaves": 4,
                "floor_headroom_scale": None,
            },
        },
    }


@pytest.fixture
def layers_json() -> dict[str, Any]:
    """Three layers at three sampled steps; `head.weight` frozen (all zero) throughout."""
    return {
        "stat": "zero_fraction",
        "layers": ["embed.weight", "blocks.0.mlp.fc1.weight", "head.weight"],
        "steps": [2, 4, 6],
        "values": [[0.01, 0.1, 1.0], [0.02, "NaN", 1.0], [0.03, 0.3, 1.0]],
        "step_width": 1,
    }


@pytest.fixture
def events_json() -> dict[str, Any]:
    return {
        "events": [
            {"kind": "run_start", "step": None, "time": 1.0, "data": {"world_size": 1}},
            {"kind": "checkpoint", "step": 4, "time": 2.0, "data": {"path": "/ckpt/4.pt"}},
        ]
    }


@pytest.fixture
def alerts_json() -> dict[str, Any]:
    """The alert engine's answer: one firing collapse, one resolved layer alert."""
    common = {"run_id": RUN_ID, "started_at": 1.0, "fired_at": 2.0, "resolved_at": None}
    return {
        "alerts": [
            {
                **common,
                "id": 2,
                "rule": "loss_scale_collapse",
                "layer": "",
                "severity": "critical",
                "status": "firing",
                "started_step": 3,
                "fired_step": 5,
                "resolved_step": None,
                "message": "loss scale 0.5 is below min_scale 1",
                "values": {"loss_scale": 0.5, "min_scale": 1.0},
            },
            {
                **common,
                "id": 1,
                "rule": "silent_underflow",
                "layer": "head.weight",
                "severity": "critical",
                "status": "resolved",
                "started_step": 2,
                "fired_step": 2,
                "resolved_step": 4,
                "resolved_at": 3.0,
                "message": "head.weight: every gradient element exactly zero",
                "values": {},
            },
        ],
        "total": 2,
        "limit": 1000,
        "offset": 0,
    }


@pytest.fixture
def advice_json() -> dict[str, Any]:
    """The restart advisor's answer: step 4 recommended, step 6 rejected."""
    return {
        "run_id": RUN_ID,
        "onset_step": 5,
        "onset_rule": "loss_scale_collapse",
        "margin_steps": 1,
        "recommended": {"step": 4, "path": "/ckpt/4.pt", "time": 2.0},
        "candidates": [
            {
                "step": 4,
                "path": "/ckpt/4.pt",
                "time": 2.0,
                "verdict": "recommended",
                "reasons": ["latest healthy checkpoint"],
                "loss_scale": 32768.0,
                "act_norm": 8.0,
            },
            {
                "step": 6,
                "path": "/ckpt/6.pt",
                "time": 3.0,
                "verdict": "rejected",
                "reasons": ["loss scale 0.5 < 1"],
                "loss_scale": 0.5,
                "act_norm": "NaN",
            },
        ],
    }


@pytest.fixture
def layer_json() -> dict[str, Any]:
    """`head.weight`'s series (any statistic) and exponent histograms."""
    return {
        "series": {
            "layer": "head.weight",
            "stat": "zero_fraction",
            "rank": 0,
            "step": [2, 4, 6],
            "value": [1.0, 1.0, "NaN"],
            "bucket_width": 1,
        },
        "histograms": {
            "layer": "head.weight",
            "rank": 0,
            "steps": [2, 4, 6],
            "offsets": [100, 99, 0],
            "counts": [[1, 2], [3, 1], [5]],
            "loss_scale": [65536.0, "Infinity", None],
        },
    }


@pytest.fixture
def collector_transport(
    run_json: dict[str, Any],
    steps_json: dict[str, Any],
    layers_json: dict[str, Any],
    events_json: dict[str, Any],
    alerts_json: dict[str, Any],
    advice_json: dict[str, Any],
    layer_json: dict[str, Any],
) -> Callable[..., httpx.MockTransport]:
    """A fake collector serving the fixtures for run `RUN_ID`; 404 for anything else.

    `make(missing=(paths...), **{path: answer})`: leave routes out (a collector without an
    alert engine) or answer others. The transport's `requests` lists what was asked.
    """

    def make(*, missing: tuple[str, ...] = (), **overrides: Any) -> httpx.MockTransport:
        run = f"/api/v1/runs/{RUN_ID}"
        answers = {
            "/api/v1/runs": {"runs": [run_json]},
            run: run_json,
            f"{run}/steps": steps_json,
            f"{run}/layers": layers_json,
            f"{run}/events": events_json,
            f"{run}/alerts": alerts_json,
            f"{run}/restart-candidates": advice_json,
            f"{run}/layers/head.weight/series": layer_json["series"],
            f"{run}/layers/head.weight/histograms": layer_json["histograms"],
            **overrides,
        }
        for path in missing:
            answers.pop(path)
        requests: list[httpx.Request] = []

        def handle(request: httpx.Request) -> httpx.Response:
            requests.append(request)
            answer = answers.get(request.url.path)
            if callable(answer):
                answer = answer(request)
            if answer is not None:
                return httpx.Response(200, content=json.dumps(answer))
            return httpx.Response(404, json={"detail": "not found"})

        transport = httpx.MockTransport(handle)
        transport.requests = requests  # type: ignore[attr-defined]
        return transport

    return make
