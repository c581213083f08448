"""The alert API over HTTP: alerts and their filters, the rule catalogue, threshold
overrides with their precedence (run > project > alerts file > defaults) and their 422s,
and per-project access."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
from alert_feed import healthy
from wire_batches import make_batch

from ampwatch.agent.wire import INGEST_PATH
from ampwatch.server import auth
from ampwatch.server.alerts import AlertConfigError, load_file
from ampwatch.server.db import make_engine, make_sessionmaker

ADMIN = "admin-token-for-the-alert-tests"
ALERTS_FILE = """
[rules.skip_rate]
max_fraction = 0.1

[projects.vision.rules.skip_rate]
max_fraction = 0.2
window_steps = 400
"""
PUBLIC_FIELDS = {
    "id", "run_id", "rule", "layer", "severity", "status", "started_step", "fired_step",
    "resolved_step", "started_at", "fired_at", "resolved_at", "message", "values",
}  # fmt: skip


@pytest.fixture
def api(
    db_url: str, tmp_path: Path, start_collector: Callable[..., AbstractContextManager[Any]]
) -> Iterator[tuple[httpx.Client, dict[str, str]]]:
    """A collector with an alerts file and an admin token; tokens of two projects."""
    path = tmp_path / "alerts.toml"
    path.write_text(ALERTS_FILE)
    with start_collector(db_url, dashboard=False, admin_token=ADMIN, alerts_file=path) as live:
        engine = make_engine(live.database_url)
        with make_sessionmaker(engine)() as session:
            tokens = {p: auth.create_token(session, project=p).token for p in ("vision", "nlp")}
        engine.dispose()
        tokens["admin"] = ADMIN
        with httpx.Client(base_url=live.url, timeout=30) as client:
            yield client, tokens


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def ingest_collapse(client: httpx.Client, token: str, run: str, project: str) -> int:
    steps = healthy(1, 100) + healthy(101, 5, scale=0.5)
    batch = make_batch(0, client_run_id=run, steps=steps)
    batch["run"]["project"] = project
    answer = client.post(INGEST_PATH, content=json.dumps(batch), headers=bearer(token))
    assert answer.status_code == 200, answer.text
    return int(answer.json()["run_id"])


def test_alerts_are_listed_with_their_fields_and_filters(
    api: tuple[httpx.Client, dict[str, str]],
) -> None:
    client, tokens = api
    admin = bearer(tokens["admin"])
    run_id = ingest_collapse(client, tokens["vision"], "r1", "vision")
    page = client.get(f"/api/v1/runs/{run_id}/alerts", headers=admin).json()
    assert page["total"] == 1 and (page["limit"], page["offset"]) == (100, 0)
    (alert,) = page["alerts"]
    assert set(alert) == PUBLIC_FIELDS
    assert (alert["rule"], alert["layer"], alert["severity"], alert["status"]) == (
        "loss_scale_collapse", "", "critical", "firing"
    )  # fmt: skip
    assert (alert["started_step"], alert["fired_step"], alert["resolved_step"]) == (101, 101, None)
    assert isinstance(alert["started_at"], float) and alert["resolved_at"] is None
    assert alert["values"]["loss_scale"] == 0.5
    assert "below min_scale 1 since step 101" in alert["message"]

    def total(path: str) -> int:
        answer = client.get(path, headers=admin)
        assert answer.status_code == 200, answer.text
        return int(answer.json()["total"])

    assert total(f"/api/v1/runs/{run_id}/alerts?status=resolved") == 0
    assert total(f"/api/v1/runs/{run_id}/alerts?severity=critical&rule=loss_scale_collapse") == 1
    assert total("/api/v1/alerts?project=vision&status=firing") == 1
    assert total("/api/v1/alerts?project=nlp") == 0
    unknown = client.get("/api/v1/alerts?rule=nope", headers=admin)
    # FastAPI's own validation error (a list), as the OpenAPI schema documents it.
    assert unknown.status_code == 422
    (problem,) = unknown.json()["detail"]
    assert problem["loc"] == ["query", "rule"] and "'loss_scale_collapse'" in problem["msg"]
    schema = client.get("/openapi.json").json()
    (rule_param,) = [p for p in schema["paths"]["/api/v1/alerts"]["get"]["parameters"]
                     if p["name"] == "rule"]  # fmt: skip
    assert "silent_underflow" in str(rule_param["schema"])
    assert client.get("/api/v1/alerts?status=open", headers=admin).status_code == 422
    runs = client.get(f"/api/v1/runs/{run_id}", headers=admin).json()
    assert runs["id"] == run_id


def test_a_project_token_reads_and_configures_only_its_project(
    api: tuple[httpx.Client, dict[str, str]],
) -> None:
    client, tokens = api
    vision_run = ingest_collapse(client, tokens["vision"], "r-vision", "vision")
    nlp_run = ingest_collapse(client, tokens["nlp"], "r-nlp", "nlp")
    vision = bearer(tokens["vision"])

    listed = client.get("/api/v1/alerts", headers=vision).json()
    assert {a["run_id"] for a in listed["alerts"]} == {vision_run}
    assert client.get(f"/api/v1/runs/{nlp_run}/alerts", headers=vision).status_code == 403
    assert client.get("/api/v1/alerts?project=nlp", headers=vision).status_code == 403
    assert client.get(f"/api/v1/runs/{nlp_run}/alert-config", headers=vision).status_code == 403
    body = {"rules": {"skip_rate": {"max_fraction": 0.5}}}
    assert client.put("/api/v1/projects/nlp/alert-config", json=body,
                      headers=vision).status_code == 403  # fmt: skip
    assert client.put(f"/api/v1/runs/{nlp_run}/alert-config", json=body,
                      headers=vision).status_code == 403  # fmt: skip
    assert client.put("/api/v1/projects/vision/alert-config", json=body,
                      headers=vision).status_code == 200  # fmt: skip
    assert client.get("/api/v1/alerts").status_code == 401
    assert client.get("/api/v1/alert-rules").status_code == 401
    missing = client.get("/api/v1/projects/ghost/alert-config", headers=bearer(tokens["admin"]))
    assert missing.status_code == 404
    assert client.get("/api/v1/runs/999999/alerts", headers=vision).status_code == 404


def test_rule_catalogue(api: tuple[httpx.Client, dict[str, str]]) -> None:
    client, tokens = api
    answer = client.get("/api/v1/alert-rules", headers=bearer(tokens["nlp"]))
    rules = {r["name"]: r for r in answer.json()["rules"]}
    assert set(rules) == {
        "loss_scale_collapse", "skip_rate", "activation_norm_spike", "silent_underflow",
        "underflow_risk", "scale_floor_stall", "no_data", "nan_loss", "fp16_without_scaler",
        "clip_before_unscale", "loss_spike", "grad_norm_spike", "overflow_burst", "fp8_risk",
        "loss_collapse", "update_rms_rise", "scale_decline", "flush_trend",
    }  # fmt: skip
    collapse = rules["loss_scale_collapse"]
    assert (collapse["severity"], collapse["scope"]) == ("critical", "run")
    assert collapse["defaults"]["min_scale"] == 1.0
    assert collapse["defaults"]["max_consecutive_skips"] == 10
    assert "DeepSpeed" in collapse["settings"]["min_scale"]
    assert rules["silent_underflow"]["scope"] == "layer"
    assert rules["flush_trend"]["scope"] == "layer"
    assert rules["update_rms_rise"]["severity"] == rules["scale_decline"]["severity"] == "warning"
    assert rules["no_data"]["defaults"] == {"enabled": True, "stale_seconds": 600.0}


def test_threshold_precedence_run_project_file_defaults(
    api: tuple[httpx.Client, dict[str, str]],
) -> None:
    client, tokens = api
    admin = bearer(tokens["admin"])
    vision_run = ingest_collapse(client, tokens["vision"], "r-vision", "vision")
    nlp_run = ingest_collapse(client, tokens["nlp"], "r-nlp", "nlp")

    def skip_rate(run_id: int) -> dict[str, Any]:
        answer = client.get(f"/api/v1/runs/{run_id}/alert-config", headers=admin)
        assert answer.status_code == 200, answer.text
        return dict(answer.json()["effective"]["skip_rate"])

    assert skip_rate(nlp_run)["max_fraction"] == 0.1  # the file's global section
    assert skip_rate(nlp_run)["window_steps"] == 500  # the default
    assert skip_rate(vision_run)["max_fraction"] == 0.2  # the file's vision section
    assert skip_rate(vision_run)["window_steps"] == 400

    project = client.put("/api/v1/projects/vision/alert-config", headers=admin,
                         json={"rules": {"skip_rate": {"max_fraction": 0.3}}})  # fmt: skip
    assert project.status_code == 200, project.text
    assert project.json()["rules"] == {"skip_rate": {"max_fraction": 0.3}}
    assert project.json()["effective"]["skip_rate"]["max_fraction"] == 0.3
    assert skip_rate(vision_run)["max_fraction"] == 0.3
    assert skip_rate(vision_run)["window_steps"] == 400  # still the file's

    overrides = {"skip_rate": {"max_fraction": 0.4, "min_steps": 7}}
    run = client.put(f"/api/v1/runs/{vision_run}/alert-config", headers=admin,
                     json={"rules": overrides})  # fmt: skip
    assert run.status_code == 200, run.text
    answer = client.get(f"/api/v1/runs/{vision_run}/alert-config", headers=admin).json()
    assert answer["rules"] == {"skip_rate": {"max_fraction": 0.4, "min_steps": 7}}
    assert answer["run_id"] == vision_run and answer["project"] == "vision"
    assert isinstance(answer["updated_at"], float)
    assert skip_rate(vision_run)["max_fraction"] == 0.4
    assert skip_rate(nlp_run)["max_fraction"] == 0.1  # untouched

    client.put(f"/api/v1/runs/{vision_run}/alert-config", headers=admin, json={"rules": {}})
    assert skip_rate(vision_run)["max_fraction"] == 0.3


BAD_OVERRIDES = [
    ({"nope": {}}, "unknown rule 'nope'"),
    ({"skip_rate": {"max_fractoin": 0.2}}, "unknown setting 'max_fractoin'"),
    ({"skip_rate": {"window_steps": "500"}}, "window_steps: Input should be a valid integer"),
    ({"skip_rate": {"enabled": 1}}, "enabled: Input should be a valid boolean"),
    ({"skip_rate": {"max_fraction": 2}}, "max_fraction: Input should be less than or equal"),
    ({"activation_norm_spike": {"signal": "loss"}}, "signal: Input should be"),
]


def test_bad_overrides_are_422_with_a_message(api: tuple[httpx.Client, dict[str, str]]) -> None:
    client, tokens = api
    run_id = ingest_collapse(client, tokens["vision"], "r-vision", "vision")
    vision = bearer(tokens["vision"])
    for rules, message in BAD_OVERRIDES:
        for path in ("/api/v1/projects/vision/alert-config", f"/api/v1/runs/{run_id}/alert-config"):
            answer = client.put(path, json={"rules": rules}, headers=vision)
            assert answer.status_code == 422, answer.text
            assert message in answer.json()["detail"], (rules, answer.json())
    not_an_object = client.put(f"/api/v1/runs/{run_id}/alert-config",
                               json={"rules": {"skip_rate": 0.2}}, headers=vision)  # fmt: skip
    assert not_an_object.status_code == 422
    extra = client.put(f"/api/v1/runs/{run_id}/alert-config", json={"rule": {}}, headers=vision)
    assert extra.status_code == 422
    for path in ("/api/v1/projects/vision/alert-config", f"/api/v1/runs/{run_id}/alert-config"):
        assert client.get(path, headers=vision).json()["rules"] == {}  # nothing stored


def test_an_alerts_file_with_mistakes_is_refused_at_load(tmp_path: Path) -> None:
    path = tmp_path / "alerts.toml"
    path.write_text("[rules.skip_rate]\nmax_fraction = 'high'\n")
    with pytest.raises(AlertConfigError, match=r"rules\.skip_rate: max_fraction"):
        load_file(path)
    path.write_text("[rule.skip_rate]\nmax_fraction = 0.1\n")
    with pytest.raises(AlertConfigError, match="unknown section"):
        load_file(path)
    path.write_text("[projects.a.rules.nope]\nx = 1\n")
    with pytest.raises(AlertConfigError, match="unknown rule 'nope'"):
        load_file(path)


def test_the_readme_table_shows_every_default() -> None:
    """README "Alert rules" documents each setting's default: it must say what the code does."""
    from ampwatch.server.alerts import RULES

    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    for rule in RULES.values():
        for name, field in rule.settings.model_fields.items():
            if name not in ("enabled", "for_steps", "resolve_steps"):
                assert f"| `{rule.name}` | `{name}` | `{field.default}` |" in readme, name
