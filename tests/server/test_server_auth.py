"""Tokens and tenancy: who may call what, on every API route, and when no token is needed."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, text
from wire_batches import layer_record, make_batch, step_record

from ampwatch.agent.wire import INGEST_PATH
from ampwatch.dashboard.client import CollectorClient, CollectorError
from ampwatch.server import auth, cli
from ampwatch.server.db import lookup_connections, make_engine, make_sessionmaker
from ampwatch.server.main import create_app
from ampwatch.server.migrate import upgrade
from ampwatch.server.models import Base, Token
from ampwatch.server.settings import Settings

ADMIN = "admin-secret-for-tests"
HEALTH_PATHS = {"/healthz", "/readyz"}
#: Routes any valid token may call: they hold no project's data (the rule catalogue).
EVERY_TOKEN = {("GET", "/api/v1/alert-rules")}


def _route_table() -> list[tuple[str, str]]:
    """(METHOD, path) of every route the collector documents: the table tests iterate."""
    schema = create_app(Settings(database_url="sqlite://", dashboard=False)).openapi()
    return [
        (method.upper(), path)
        for path, operations in schema["paths"].items()
        for method in operations
        if path not in HEALTH_PATHS
    ]


ROUTES = _route_table()


def ingest_batch_json(project: str | None, client_run_id: str = "run-x") -> dict[str, Any]:
    batch: dict[str, Any] = dict(
        make_batch(
            0,
            client_run_id=client_run_id,
            steps=[step_record(1, loss=1.0)],
            layer_stats=[layer_record(1, ["w"], [0.5])],
        )
    )
    run = dict(batch["run"])
    if project is None:
        del run["project"]
    else:
        run["project"] = project
    batch["run"] = run
    return batch


class Tenants:
    """A collector with projects `vision` and `nlp`, a token for each, one run each."""

    def __init__(self, url: str, database_url: str) -> None:
        self.url = url
        self.database_url = database_url
        self.engine = make_engine(database_url)
        with make_sessionmaker(self.engine)() as session:
            self.vision = auth.create_token(session, project="vision").token
            self.nlp = auth.create_token(session, project="nlp").token
        self.runs = {
            project: self.post(
                INGEST_PATH, token, ingest_batch_json(project, f"{project}-run")
            ).json()["run_id"]
            for project, token in (("vision", self.vision), ("nlp", self.nlp))
        }

    def post(self, path: str, token: str | None, body: Any) -> httpx.Response:
        return self.request("POST", path, token, json=body)

    def request(self, method: str, path: str, token: str | None, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.request(method, self.url + path, headers=headers, timeout=30, **kwargs)

    def counts(self) -> dict[str, int]:
        with self.engine.connect() as connection:
            return {
                name: connection.scalar(select(func.count()).select_from(table)) or 0
                for name, table in Base.metadata.tables.items()
            }


@pytest.fixture
def tenants(
    db_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> Iterator[Tenants]:
    with start_collector(db_url, dashboard=False, admin_token=ADMIN) as live:
        world = Tenants(live.url, db_url)
        yield world
        world.engine.dispose()


def _alert_config_body(method: str) -> dict[str, Any]:
    return {"json": {"rules": {}}} if method == "PUT" else {}


def _request_for(route: tuple[str, str], tenants: Tenants, project: str) -> dict[str, Any]:
    """A request through `route` that touches `project`'s data (a run of it, or its name)."""
    method, path = route
    if "{run_id}" in path:
        path = path.replace("{run_id}", str(tenants.runs[project])).replace("{layer}", "w")
        return {"method": method, "path": path, **_alert_config_body(method)}
    if "{project}" in path:  # /projects/{project}/alert-config
        path = path.replace("{project}", project)
        return {"method": method, "path": path, **_alert_config_body(method)}
    if "{webhook_id}" in path:  # a webhook of `project`'s, made by the admin for the call
        hook = {"url": "http://127.0.0.1:9/hook", "project": project}
        webhook_id = tenants.post("/api/v1/webhooks", ADMIN, hook).json()["id"]
        return {"method": method, "path": path.replace("{webhook_id}", str(webhook_id))}
    cases: dict[tuple[str, str], dict[str, Any]] = {
        ("GET", "/api/v1/runs"): {"params": {"project": project}},
        ("POST", "/api/v1/runs"): {
            "json": {"client_run_id": f"{project}-new", "name": "n", "project": project}
        },
        ("POST", INGEST_PATH): {"json": ingest_batch_json(project, f"{project}-new")},
        ("GET", "/metrics"): {},
        ("GET", "/api/v1/webhooks"): {"params": {"project": project}},
        ("POST", "/api/v1/webhooks"): {"json": {"url": "http://h.example/", "project": project}},
        ("GET", "/api/v1/alerts"): {"params": {"project": project}},
        ("GET", "/api/v1/alert-rules"): {},
    }
    if route not in cases:
        pytest.fail(f"no auth case for new route {method} {path}: add one to _request_for")
    return {"method": method, "path": path, **cases[route]}


@pytest.mark.parametrize("route", ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_every_route_checks_the_token_and_its_project(
    route: tuple[str, str], tenants: Tenants
) -> None:
    call = _request_for(route, tenants, "nlp")
    before = tenants.counts()
    method, path = call.pop("method"), call.pop("path")

    missing = tenants.request(method, path, None, **call)
    assert missing.status_code == 401, missing.text
    assert missing.headers["www-authenticate"] == "Bearer"
    assert "token" in missing.json()["detail"]

    wrong = tenants.request(method, path, tenants.vision, **call)
    if (method, path) in EVERY_TOKEN:
        assert wrong.status_code == 200, wrong.text
        return
    if path == "/metrics":  # names no project: each token scrapes its own project's series
        assert wrong.status_code == 200, wrong.text
        assert 'project="vision"' in wrong.text and 'project="nlp"' not in wrong.text
        return
    assert wrong.status_code == 403, wrong.text
    assert "vision" in wrong.json()["detail"]
    assert tenants.counts() == before  # refused writes stored nothing

    own = tenants.request(method, path, tenants.nlp, **call)
    admin = tenants.request(method, path, ADMIN, **call)
    assert own.status_code not in (401, 403, 500), own.text
    assert admin.status_code not in (401, 403, 500), admin.text


def test_openapi_documents_the_auth_errors() -> None:
    schema = create_app(Settings(database_url="sqlite://", dashboard=False)).openapi()
    assert "HTTPBearer" in schema["components"]["securitySchemes"]
    for method, path in ROUTES:
        responses = schema["paths"][path][method.lower()]["responses"]
        assert "401" in responses, f"{method} {path}"
        assert "403" in responses or (method, path) in EVERY_TOKEN, f"{method} {path}"


def test_a_project_token_sees_only_its_project(tenants: Tenants) -> None:
    listed = tenants.request("GET", "/api/v1/runs", tenants.vision).json()
    assert [run["project"] for run in listed["runs"]] == ["vision"]
    everything = tenants.request("GET", "/api/v1/runs", ADMIN).json()
    assert sorted(run["project"] for run in everything["runs"]) == ["nlp", "vision"]


def test_an_alert_list_is_kept_for_its_tenant_alone(tenants: Tenants) -> None:
    """One URL answers each tenant its own alerts: a kept page, or a tag, of one project is
    never another's (the tag names the projects it covers)."""
    for project, token in (("vision", tenants.vision), ("nlp", tenants.nlp)):
        batch = ingest_batch_json(project, f"{project}-run") | {"seq": 1}
        batch["steps"], batch["layer_stats"] = [step_record(2, loss=float("nan"))], []
        assert tenants.post(INGEST_PATH, token, batch).status_code == 200

    def alerts(token: str, tag: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} | ({"If-None-Match": tag} if tag else {})
        return httpx.get(f"{tenants.url}/api/v1/alerts", headers=headers, timeout=30)

    tags = {}
    for project, token in (("vision", tenants.vision), ("nlp", tenants.nlp)):
        for _ in range(2):  # the second answer is the kept one
            answer = alerts(token)
            assert answer.status_code == 200
            assert {a["run_id"] for a in answer.json()["alerts"]} == {tenants.runs[project]}
        tags[project] = answer.headers["etag"]
    assert tags["vision"] != tags["nlp"]
    assert alerts(tenants.vision, tags["vision"]).status_code == 304
    crossed = alerts(tenants.nlp, tags["vision"])
    assert crossed.status_code == 200
    assert {a["run_id"] for a in crossed.json()["alerts"]} == {tenants.runs["nlp"]}
    everyone = alerts(ADMIN)
    assert {a["run_id"] for a in everyone.json()["alerts"]} == set(tenants.runs.values())
    assert everyone.headers["etag"] not in tags.values()


def test_a_batch_without_project_goes_to_the_tokens_project(tenants: Tenants) -> None:
    ack = tenants.post(INGEST_PATH, tenants.vision, ingest_batch_json(None, "unnamed"))
    assert ack.status_code == 200, ack.text
    run = tenants.request("GET", f"/api/v1/runs/{ack.json()['run_id']}", tenants.vision).json()
    assert run["project"] == "vision"


def test_a_run_of_another_project_cannot_be_written_by_naming_it(tenants: Tenants) -> None:
    nlp_run = tenants.request("GET", f"/api/v1/runs/{tenants.runs['nlp']}", ADMIN).json()
    squat = ingest_batch_json(None, "nlp-run")  # nlp's client_run_id, no project named
    answer = tenants.post(INGEST_PATH, tenants.vision, squat)
    # Client run ids are per project: vision gets a run of its own, nlp's is untouched.
    assert answer.status_code == 200, answer.text
    assert answer.json()["run_id"] != tenants.runs["nlp"]
    mine = tenants.request("GET", f"/api/v1/runs/{answer.json()['run_id']}", tenants.vision)
    assert mine.json()["project"] == "vision"
    after = tenants.request("GET", f"/api/v1/runs/{tenants.runs['nlp']}", ADMIN).json()
    assert (after["steps"], after["last_seen_at"]) == (nlp_run["steps"], nlp_run["last_seen_at"])


def test_a_403_names_no_other_project(tenants: Tenants) -> None:
    for method, path in (("GET", "/api/v1/runs/{}"), ("GET", "/api/v1/runs/{}/steps")):
        answer = tenants.request(method, path.format(tenants.runs["nlp"]), tenants.vision)
        assert answer.status_code == 403
        assert "nlp" not in answer.text and "vision" in answer.json()["detail"]


def test_admin_creates_projects_by_naming_them(tenants: Tenants) -> None:
    ack = tenants.post(INGEST_PATH, ADMIN, ingest_batch_json("speech", "speech-run"))
    assert ack.status_code == 200, ack.text
    with tenants.engine.connect() as connection:
        names = set(connection.scalars(text("SELECT name FROM projects")))
    assert names == {"default", "vision", "nlp", "speech"}


@pytest.mark.parametrize(
    "header",
    [
        "Bearer aw_00000000_not-a-real-secret",
        "Bearer nonsense",
        "Bearer",
        "Basic dXNlcjpwYXNz",
        f"Bearer {ADMIN}x",
    ],
)
def test_unknown_or_malformed_credentials_are_401(tenants: Tenants, header: str) -> None:
    answer = httpx.get(f"{tenants.url}/api/v1/runs", headers={"Authorization": header})
    assert answer.status_code == 401
    assert answer.headers["www-authenticate"] == "Bearer"


def test_a_token_with_the_right_prefix_but_wrong_secret_is_401(tenants: Tenants) -> None:
    forged = tenants.vision[:-4] + "AAAA"
    assert tenants.request("GET", "/api/v1/runs", forged).status_code == 401


def test_a_revoked_token_is_refused_at_once(tenants: Tenants) -> None:
    assert tenants.request("GET", "/api/v1/runs", tenants.vision).status_code == 200
    with make_sessionmaker(tenants.engine)() as session:
        assert auth.revoke_token(session, tenants.vision.split("_")[1])
    answer = tenants.request("GET", "/api/v1/runs", tenants.vision)
    assert answer.status_code == 401
    assert "revoked" in answer.json()["detail"]


def test_tokens_are_stored_hashed(tenants: Tenants) -> None:
    with tenants.engine.connect() as connection:
        dump = json.dumps(
            [
                [str(value) for value in row]
                for table in Base.metadata.sorted_tables
                for row in connection.execute(select(table))
            ]
        )
        hashes = set(connection.scalars(select(Token.secret_hash)))
    for token in (tenants.vision, tenants.nlp):
        assert token not in dump and token.split("_", 2)[2] not in dump
        assert hashlib.sha256(token.encode()).hexdigest() in hashes


def test_open_on_loopback_until_the_first_token(
    sqlite_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> None:
    with start_collector(sqlite_url, dashboard=False) as live:
        assert httpx.post(live.url + INGEST_PATH, json=ingest_batch_json(None)).status_code == 200
        engine = make_engine(sqlite_url)
        with make_sessionmaker(engine)() as session:
            token = auth.create_token(session, project="default").token
        engine.dispose()
        # The running collector sees the new token at once: nothing is cached in-process.
        assert httpx.get(live.url + "/api/v1/runs").status_code == 401
        answer = httpx.get(live.url + "/api/v1/runs", headers={"Authorization": f"Bearer {token}"})
        assert answer.status_code == 200


@pytest.mark.parametrize(
    ("mode", "admin", "status"),
    [("token", None, 401), ("auto", ADMIN, 401), ("open", ADMIN, 200)],
)
def test_auth_modes_on_loopback_without_stored_tokens(
    sqlite_url: str,
    start_collector: Callable[..., AbstractContextManager[Any]],
    mode: str,
    admin: str | None,
    status: int,
) -> None:
    with start_collector(sqlite_url, dashboard=False, auth=mode, admin_token=admin) as live:
        assert httpx.get(live.url + "/api/v1/runs").status_code == status


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True),
     ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.0.0.5", False),
     ("collector.example.com", False)],
)  # fmt: skip
def test_is_loopback(host: str, loopback: bool) -> None:
    assert auth.is_loopback(host) is loopback


def _start(app: Any) -> None:
    async def lifespan() -> None:
        async with app.router.lifespan_context(app):
            pass

    asyncio.run(lifespan())


def test_refuses_to_serve_the_network_without_a_token(sqlite_url: str) -> None:
    upgrade(sqlite_url)
    exposed = Settings(database_url=sqlite_url, host="0.0.0.0", dashboard=False)
    with pytest.raises(RuntimeError, match="ampwatch token create --project") as refused:
        _start(create_app(exposed))
    assert "AMPWATCH_ADMIN_TOKEN" in str(refused.value)
    assert "AMPWATCH_AUTH=open" in str(refused.value)
    _start(create_app(exposed.model_copy(update={"auth": "open"})))
    _start(create_app(Settings(database_url=sqlite_url, host="0.0.0.0", dashboard=False,
                               admin_token=ADMIN)))  # fmt: skip
    engine = make_engine(sqlite_url)
    with make_sessionmaker(engine)() as session:
        auth.create_token(session, project="p")
    engine.dispose()
    _start(create_app(exposed))


def test_cli_creates_lists_and_revokes_tokens(
    sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["token", "create", "--project", "vision", "--name", "ci",
                     "--database-url", sqlite_url]) == 0  # fmt: skip
    token = capsys.readouterr().out.strip().splitlines()[-1]
    prefix = token.split("_")[1]
    assert token.startswith(f"aw_{prefix}_")
    assert cli.main(["token", "create", "--admin", "--database-url", sqlite_url]) == 0
    capsys.readouterr()
    assert cli.main(["token", "list", "--database-url", sqlite_url]) == 0
    listing = capsys.readouterr().out
    assert f"{prefix}  vision  ci  active" in listing and "(admin: every project)" in listing
    assert token.split("_", 2)[2] not in listing
    assert cli.main(["token", "revoke", prefix, "--database-url", sqlite_url]) == 0
    assert cli.main(["token", "revoke", "nosuch", "--database-url", sqlite_url]) == 1
    capsys.readouterr()
    cli.main(["token", "list", "--database-url", sqlite_url])
    assert f"{prefix}  vision  ci  revoked" in capsys.readouterr().out


def test_dashboard_client_sends_its_token(tenants: Tenants) -> None:
    assert [r.project for r in CollectorClient(tenants.url, token=tenants.nlp).list_runs()] == [
        "nlp"
    ]
    with pytest.raises(CollectorError, match="401"):
        CollectorClient(tenants.url).list_runs()


def test_mounted_dashboard_gets_the_dashboard_token(monkeypatch: pytest.MonkeyPatch) -> None:
    import ampwatch.dashboard.app as dashboard_app

    seen: dict[str, Any] = {}
    real = dashboard_app.create_dash_app

    def spy(api_url: str, **kwargs: Any) -> Any:
        seen.update(kwargs)
        return real(api_url, **kwargs)

    monkeypatch.setattr(dashboard_app, "create_dash_app", spy)
    create_app(Settings(database_url="sqlite://", dashboard_token="dash-token"))
    assert seen["token"] == "dash-token"


def test_migration_to_projects_keeps_every_run_and_its_data(db_url: str) -> None:
    from ampwatch.server.migrate import downgrade

    upgrade(db_url, "0002")
    engine = make_engine(db_url)
    try:
        with engine.begin() as connection:
            connection.execute(text(
                "INSERT INTO runs (id, client_run_id, name, project, status, created_at, "
                "last_seen_at) VALUES (7, 'r', 'n', 'legacy', 'running', :t, :t)"
            ), {"t": "2026-01-01 00:00:00"})  # fmt: skip
            connection.execute(text("INSERT INTO steps (run_id, rank, step, skipped) "
                                    "VALUES (7, 0, 1, false)"))  # fmt: skip
        upgrade(db_url)
        with engine.connect() as connection:
            # The rebuild of `runs` (SQLite batch mode) must not cascade into its children.
            assert connection.scalar(text("SELECT count(*) FROM steps WHERE run_id = 7")) == 1
            projects = set(connection.scalars(text("SELECT name FROM projects")))
            assert projects == {"default", "legacy"}
        downgrade(db_url, "0002")
        with engine.connect() as connection:
            assert connection.scalar(text("SELECT count(*) FROM steps WHERE run_id = 7")) == 1
    finally:
        engine.dispose()


def test_a_short_admin_token_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        Settings(admin_token="hunter2")


def test_the_callers_lookup_runs_outside_a_transaction_on_postgresql(db_url: str) -> None:
    """`db.lookup_connections`: on PostgreSQL each statement of the caller's lookup is its own
    (no BEGIN / ROLLBACK round trips), so two statements see two clocks; on SQLite the
    lookup is a plain transaction (a statement outside one costs more there)."""
    upgrade(db_url)
    engine = make_engine(db_url)
    try:
        with lookup_connections(engine)() as connection:
            if engine.dialect.name == "sqlite":
                assert connection.get_isolation_level() == "SERIALIZABLE"
                return
            first = connection.execute(text("SELECT now()")).scalar()
            connection.execute(text("SELECT pg_sleep(0.01)"))
            second = connection.execute(text("SELECT now()")).scalar()
            assert first is not None and second is not None and second > first
        with make_sessionmaker(engine)() as session:  # a plain session: one transaction
            first = session.execute(text("SELECT now()")).scalar()
            session.execute(text("SELECT pg_sleep(0.01)"))
            assert session.execute(text("SELECT now()")).scalar() == first
    finally:
        engine.dispose()
