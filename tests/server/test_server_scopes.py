"""Token scopes on every route of the app: a `metrics` token scrapes `/metrics` and is
refused (403) everywhere else; a `read` token reads everything of its project and writes
nothing; made without a project, either covers every project with the same limits."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest
from fastapi.routing import APIRoute
from scraped import parse, scrape, series
from sqlalchemy import text
from test_server_auth import ADMIN, HEALTH_PATHS, Tenants, _request_for

from ampwatch.server import auth, cli
from ampwatch.server.db import make_engine, make_sessionmaker
from ampwatch.server.main import create_app
from ampwatch.server.migrate import downgrade, upgrade
from ampwatch.server.settings import Settings


def _walk(routes: list[Any], prefix: str = "") -> Iterator[tuple[str, APIRoute]]:
    # FastAPI keeps included routers as branches (`original_router`, with the include's
    # prefix); a FastAPI that changes this fails here, loudly, rather than skip routes.
    for route in routes:
        if isinstance(route, APIRoute):
            yield prefix + route.path, route
        elif hasattr(route, "original_router"):
            yield from _walk(route.original_router.routes, prefix + route.include_context.prefix)


def _app_routes() -> list[tuple[str, str]]:
    """(METHOD, path) of every API route the app serves, documented or not: a route added
    later is in this list, so it cannot escape the scope checks."""
    app = create_app(Settings(database_url="sqlite://", dashboard=False))
    return sorted(
        (method, re.sub(r"\{(\w+):\w+\}", r"{\1}", path))  # {layer:path} as OpenAPI writes it
        for path, route in _walk(app.routes)
        if path not in HEALTH_PATHS
        for method in route.methods
    )


ROUTES = _app_routes()


class Scoped(Tenants):
    """`Tenants` plus a read and a metrics token of `nlp`, and of every project."""

    def __init__(self, url: str, database_url: str) -> None:
        super().__init__(url, database_url)
        with make_sessionmaker(self.engine)() as session:
            self.tokens = {
                (scope, project): auth.create_token(session, project=project, scope=scope).token
                for scope in ("read", "metrics")
                for project in ("nlp", None)
            }


@pytest.fixture
def scoped(
    db_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> Iterator[Scoped]:
    with start_collector(db_url, dashboard=False, admin_token=ADMIN) as live:
        world = Scoped(live.url, db_url)
        yield world
        world.engine.dispose()


def test_the_route_table_is_the_documented_one() -> None:
    """Every served API route is documented too, so OpenAPI-driven tests see them all."""
    schema = create_app(Settings(database_url="sqlite://", dashboard=False)).openapi()
    documented = {(m.upper(), p) for p, ops in schema["paths"].items() for m in ops}
    assert set(ROUTES) == documented - {(m, p) for m, p in documented if p in HEALTH_PATHS}
    assert ("GET", "/metrics") in ROUTES and len(ROUTES) > 20


@pytest.mark.parametrize("project", ["nlp", None], ids=["project", "every-project"])
def test_a_metrics_token_scrapes_and_is_refused_everywhere_else(
    scoped: Scoped, project: str | None
) -> None:
    token = scoped.tokens[("metrics", project)]
    before = scoped.counts()
    for route in ROUTES:
        call = _request_for(route, scoped, "nlp")
        method, path = call.pop("method"), call.pop("path")
        answer = scoped.request(method, path, token, **call)
        if path == "/metrics":
            assert answer.status_code == 200, answer.text
            continue
        assert answer.status_code == 403, (method, path, answer.status_code, answer.text)
        assert "--scope" in answer.json()["detail"], answer.text
    _assert_nothing_written(scoped, before)


@pytest.mark.parametrize("project", ["nlp", None], ids=["project", "every-project"])
def test_a_read_token_reads_every_route_and_writes_none(
    scoped: Scoped, project: str | None
) -> None:
    token = scoped.tokens[("read", project)]
    before = scoped.counts()
    reads = 0
    for route in ROUTES:
        call = _request_for(route, scoped, "nlp")
        method, path = call.pop("method"), call.pop("path")
        answer = scoped.request(method, path, token, **call)
        if method == "GET":
            assert answer.status_code not in (401, 403, 500), (method, path, answer.text)
            reads += 1
        else:
            assert answer.status_code == 403, (method, path, answer.status_code, answer.text)
            assert "'write' access" in answer.json()["detail"], answer.text
    assert reads >= 10
    _assert_nothing_written(scoped, before)


def _assert_nothing_written(scoped: Scoped, before: dict[str, int]) -> None:
    """Only the webhooks `_request_for` made with the admin token, one per webhook route."""
    after = scoped.counts()
    assert {k: after[k] - before[k] for k in after if after[k] != before[k]} == {
        "webhooks": sum(1 for _m, p in ROUTES if "{webhook_id}" in p)
    }


def test_a_project_scrape_holds_only_that_projects_series(scoped: Scoped) -> None:
    mine = parse(scrape(scoped.url, scoped.tokens[("metrics", "nlp")]).text)
    everyone = parse(scrape(scoped.url, scoped.tokens[("metrics", None)]).text)
    projects = {dict(k)["project"] for k in series(mine, "ampwatch_run_running")}
    assert projects == {"nlp"}
    assert {dict(k)["project"] for k in series(everyone, "ampwatch_run_running")} == {
        "nlp", "vision"
    }  # fmt: skip
    # This process's counters count every project's traffic: for all-project tokens only.
    assert not series(mine, "ampwatch_ingest_batches_total")
    assert series(everyone, "ampwatch_ingest_batches_total")
    # A write token of a project scrapes its project too (every scope grants metrics).
    own = parse(scrape(scoped.url, scoped.nlp).text)
    assert {dict(k)["project"] for k in series(own, "ampwatch_run_running")} == {"nlp"}


def test_cli_creates_scoped_tokens(sqlite_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["token", "create", "--project", "vision", "--scope", "metrics",
                     "--database-url", sqlite_url]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert printed.startswith("metrics token ")
    prefix = printed.strip().splitlines()[-1].split("_")[1]
    assert cli.main(["token", "create", "--project", "vision", "--database-url", sqlite_url]) == 0
    capsys.readouterr()
    assert cli.main(["token", "list", "--database-url", sqlite_url]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0].startswith(prefix) and listing[0].endswith("active  metrics")
    assert listing[1].endswith("active  write")  # the default, as before scopes
    with pytest.raises(SystemExit):
        cli.main(["token", "create", "--admin", "--scope", "admin", "--database-url", sqlite_url])


def test_tokens_made_before_scopes_keep_writing(db_url: str) -> None:
    upgrade(db_url, "0006")
    engine = make_engine(db_url)
    try:
        with engine.begin() as connection:
            connection.execute(text(
                "INSERT INTO tokens (prefix, secret_hash, name, created_at) "
                "VALUES ('0ld0ld00', 'h', 'old', :t)"), {"t": "2026-01-01 00:00:00"})  # fmt: skip
        upgrade(db_url)
        with engine.connect() as connection:
            assert connection.scalar(text("SELECT scope FROM tokens")) == "write"
        downgrade(db_url, "0006")
        with engine.connect() as connection:
            assert connection.scalar(text("SELECT count(*) FROM tokens")) == 1
    finally:
        engine.dispose()


def test_an_unknown_scope_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown token scope"):
        auth.create_token(None, project="p", scope="admin")  # type: ignore[arg-type]
