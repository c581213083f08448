"""The production deployment: docker-compose.yml checked against the Compose
specification (no Docker engine runs here), and the same processes it starts run by hand
against the real PostgreSQL: migrate once, a collector with two workers, the standalone
dashboard, a real agent run into it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from reliability_procs import CollectorProcess, RowCounter, wait_for
from reliability_support import STEPS_DEFAULT, Trainer, assert_exactly_once, stored_run
from sqlalchemy import select

from ampwatch.server import auth
from ampwatch.server.db import make_engine, make_sessionmaker
from ampwatch.server.models import Run
from ampwatch.server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
ADMIN = "admin-token-for-the-deployment-test"


def _check_jsonschema() -> str:
    beside_python = Path(sys.executable).with_name("check-jsonschema")
    found = shutil.which("check-jsonschema") or str(beside_python)
    if not Path(found).exists():
        pytest.skip("check-jsonschema is not installed (pip install 'ampwatch[test]')")
    return found


def test_compose_file_validates_against_the_compose_specification() -> None:
    """check-jsonschema ships the Compose spec's schema (vendor.compose-spec): offline."""
    env = {**os.environ, "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}
    result = subprocess.run(
        [_check_jsonschema(), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_schema_check_catches_a_broken_compose_file(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    broken.write_text("services:\n  collector:\n    depends_on:\n      migrate:\n"
                      "        condition: when_it_feels_like_it\n")  # fmt: skip
    result = subprocess.run(
        [_check_jsonschema(), "--builtin-schema", "vendor.compose-spec", str(broken)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0


def _compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text()))


def _default(value: str) -> str:
    """The value compose would use with nothing in .env: `${VAR:-default}` -> default."""
    match = re.fullmatch(r"\$\{\w+:-([^}]*)\}", str(value))
    return match.group(1) if match else str(value)


def test_compose_structure_matches_the_deployment() -> None:
    services = _compose()["services"]
    assert set(services) >= {"postgres", "migrate", "collector", "dashboard"}
    postgres = services["postgres"]
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    assert any(str(v).endswith(":/var/lib/postgresql/data") for v in postgres["volumes"])

    migrate = services["migrate"]
    assert migrate["command"] == ["ampwatch", "db", "upgrade"]
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"

    collector = services["collector"]
    assert collector["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert collector["depends_on"]["postgres"]["condition"] == "service_healthy"
    env = collector["environment"]
    assert int(_default(env["AMPWATCH_WORKERS"])) >= 2
    assert str(env["AMPWATCH_MIGRATE"]).lower() == "false"  # only `migrate` migrates
    assert "/readyz" in " ".join(collector["healthcheck"]["test"])

    dashboard = services["dashboard"]
    assert dashboard["depends_on"]["collector"]["condition"] == "service_healthy"
    assert "http://collector:8765" in dashboard["command"]


def test_compose_monitoring_profile_is_off_by_default_and_wired_to_deploy() -> None:
    """Prometheus and Grafana start only with --profile monitoring; what they mount is in
    deploy/, and Prometheus reads its scrape token from the secret compose mounts."""
    compose = _compose()
    services = compose["services"]
    monitoring = {name for name, svc in services.items() if svc.get("profiles")}
    assert monitoring == {"prometheus", "grafana"}
    assert all(services[name]["profiles"] == ["monitoring"] for name in monitoring)
    for name in monitoring:
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), (name, source)
        assert all(port.startswith("127.0.0.1:") for port in services[name]["ports"])
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    (secret,) = services["prometheus"]["secrets"]
    assert job["authorization"]["credentials_file"] == f"/run/secrets/{secret}"
    assert compose["secrets"][secret] == {"environment": "PROMETHEUS_AMPWATCH_TOKEN"}
    assert job["static_configs"][0]["targets"] == ["collector:8765"]


def test_compose_configures_only_real_settings_and_takes_secrets_from_the_environment() -> None:
    """Every AMPWATCH_* variable the collector and migration get is a Settings field, and
    no secret is written in the file (each comes from the environment, `${...}`)."""
    fields = {f"AMPWATCH_{name.upper()}" for name in Settings.model_fields}
    services = _compose()["services"]
    for name in ("migrate", "collector"):
        env = services[name]["environment"]
        unknown = {key for key in env if key.startswith("AMPWATCH_")} - fields
        assert not unknown, f"{name}: {unknown} are not Settings fields"
    secrets = {"AMPWATCH_ADMIN_TOKEN", "AMPWATCH_DASHBOARD_TOKEN", "POSTGRES_PASSWORD"}
    for service in services.values():
        for key, value in (service.get("environment") or {}).items():
            if key in secrets:
                assert str(value).startswith("${") and ":?" in str(value), (key, value)
    url = services["migrate"]["environment"]["AMPWATCH_DATABASE_URL"]
    assert "${POSTGRES_PASSWORD" in url


def test_env_example_names_every_variable_compose_reads_and_holds_no_secret() -> None:
    text = COMPOSE.read_text()
    used = set(re.findall(r"\$\{(\w+)", text))
    example = ROOT / ".env.example"
    assigned = dict(
        line.split("=", 1)
        for line in example.read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert used <= set(assigned), used - set(assigned)
    for key in ("POSTGRES_PASSWORD", "AMPWATCH_ADMIN_TOKEN", "AMPWATCH_DASHBOARD_TOKEN"):
        assert assigned[key].startswith("change-me"), key
    assert ".env" in (ROOT / ".gitignore").read_text().split()  # the real one stays local
    for key, value in assigned.items():  # the example values are valid settings
        if key.startswith("AMPWATCH_") and key != "AMPWATCH_DASHBOARD_TOKEN":
            name = key.removeprefix("AMPWATCH_").lower()
            Settings(**{name: value} if name != "cors_origins" else {})
    assert Settings.model_validate({}).cors_origins == []


def test_workers_rebuild_the_same_settings_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`serve` exports its Settings for the worker processes; each rebuilds them equal."""
    from ampwatch.server.serving import settings_environment

    settings = Settings(
        database_url="postgresql+psycopg://u@db/ampwatch", host="0.0.0.0", port=9000,
        workers=3, migrate=False, dashboard=False, admin_token="a" * 20,
        cors_origins=["https://ops.example"], auth="token",
    )  # fmt: skip
    for key, value in settings_environment(settings).items():
        monkeypatch.setenv(key, value)
    assert Settings() == settings


def test_cli_flags_reach_the_settings() -> None:
    from ampwatch.server.cli import build_parser
    from ampwatch.server.cli.options import settings_from

    args = build_parser().parse_args(["serve", "--workers", "2", "--no-migrate"])
    settings = settings_from(args)
    assert settings.workers == 2 and settings.migrate is False
    assert settings_from(build_parser().parse_args(["serve"])).migrate is True


@pytest.mark.postgres
def test_hand_run_deployment_two_workers_dashboard_and_an_agent(
    migrated_postgres: str,
    collector_process: Callable[..., CollectorProcess],
    dashboard_process: Callable[..., str],
    rows: RowCounter,
) -> None:
    """The compose services as processes: `ampwatch db upgrade` (fixture), then
    `ampwatch serve --workers 2 --no-migrate` with an admin token as compose sets it,
    the dashboard alone with a project token, and a real FP16 run streamed into it."""
    engine = make_engine(migrated_postgres)
    with make_sessionmaker(engine)() as session:
        token = auth.create_token(session, project="vision").token
    engine.dispose()
    collector = collector_process(workers=2, AMPWATCH_ADMIN_TOKEN=ADMIN, AMPWATCH_AUTH="token")
    assert len(collector.worker_pids()) == 2

    trainer = Trainer()
    handle = trainer.watch(url=collector.url, token=token, run="deployed", project="vision")
    trainer.train(STEPS_DEFAULT)
    handle.detach(timeout=30)
    wait_for(
        lambda: (
            rows.scalar(select(Run.status).where(Run.client_run_id == handle.client_run_id))
            == "ended"
        ),
        what="run end",
    )
    assert handle.counters["batches_sent"] >= 2 and handle.counters["send_failures"] == 0
    assert_exactly_once(stored_run(rows, handle.client_run_id), STEPS_DEFAULT)

    # Both workers serve the one port, and whichever answers /metrics counts for both
    # (tests/reliability/test_reliability_workers.py): fresh connections read one total.
    headers = {"Authorization": f"Bearer {ADMIN}"}
    totals = {
        re.search(r"^ampwatch_ingest_steps_total (\d+)$", text, re.M).group(1)  # type: ignore[union-attr]
        for text in (
            httpx.get(f"{collector.url}/metrics", headers=headers, timeout=10).text
            for _ in range(6)
        )
    }
    assert totals == {str(STEPS_DEFAULT)}

    dashboard = dashboard_process(collector.url, token)
    page = httpx.get(f"{dashboard}/", timeout=30)
    assert page.status_code == 200 and "<html" in page.text.lower()
    layout = httpx.get(f"{dashboard}/_dash-layout", timeout=30)
    assert layout.status_code == 200
    # The dashboard reads through the collector with its project token.
    runs = httpx.get(
        f"{collector.url}/api/v1/runs", headers={"Authorization": f"Bearer {token}"}, timeout=10
    ).json()
    assert [run["client_run_id"] for run in runs["runs"]] == [handle.client_run_id]
