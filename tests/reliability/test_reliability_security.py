"""Tenancy and exposure, generated from the route table at run time (endpoints added later
are covered without editing this file):

- a project's token can neither read nor write another project's runs, on every route
  that takes a run, a project, or another project's object;
- no list or search answers with another project's data;
- tokens are hashed at rest; no SQL is built from strings anywhere in the collector;
- CORS is closed unless `AMPWATCH_CORS_ORIGINS` names origins;
- the standalone dashboard shows only what its token may read.
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
from reliability_procs import RowCounter, record_figure
from sqlalchemy import select

from ampwatch.agent.wire import INGEST_PATH, LAYER_STATS, WIRE_VERSION
from ampwatch.server import auth
from ampwatch.server.db import make_engine, make_sessionmaker
from ampwatch.server.models import Token

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "admin-token-for-the-security-test"
#: Markers of the other tenant's data: none may appear in an answer to the first tenant.
THEIRS = {"project": "tenant-b-7f3a", "run": "tenant-b-run-7f3a", "layer": "b.secret.weight"}
MINE = {"project": "tenant-a", "run": "tenant-a-run", "layer": "a.weight"}
PUBLIC_PATHS = {"/healthz", "/readyz", "/openapi.json", "/docs", "/redoc"}


def batch(owner: dict[str, str], seq: int = 0, *, project: bool = True) -> dict[str, Any]:
    run: dict[str, Any] = {"client_run_id": owner["run"], "name": owner["run"]}
    if project:
        run["project"] = owner["project"]
    return {
        "wire_version": WIRE_VERSION,
        "run": run,
        "stream": "5ec",
        "seq": seq,
        "steps": [{"step": 1, "rank": 0, "skipped": False, "loss": 1.0, "loss_scale": 2.0}],
        "layer_stats": [
            {
                "step": 1,
                "rank": 0,
                "names": [owner["layer"]],
                "stats": {stat: [0.5] for stat in LAYER_STATS},
            }
        ],
        "events": [
            {
                "kind": "checkpoint",
                "step": 1,
                "time": 1.7e9,
                "data": {"path": f"/ckpt/{owner['run']}.pt"},
            }
        ],
        "dropped": {"steps": 0, "layer_stats": 0, "events": 0},
    }


class Tenants:
    def __init__(self, url: str, database_url: str) -> None:
        self.url = url
        self.database_url = database_url
        engine = make_engine(database_url)
        with make_sessionmaker(engine)() as session:
            self.mine = auth.create_token(session, project=MINE["project"]).token
            self.theirs = auth.create_token(session, project=THEIRS["project"]).token
        engine.dispose()
        self.run_ids = {}
        for owner, token in ((MINE, self.mine), (THEIRS, self.theirs)):
            answer = self.call("POST", INGEST_PATH, token, json=batch(owner))
            assert answer.status_code == 200, answer.text
            self.run_ids[owner["project"]] = answer.json()["run_id"]
        self.schema = httpx.get(f"{url}/openapi.json", timeout=30).json()

    def call(self, method: str, path: str, token: str | None, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.request(method, self.url + path, headers=headers, timeout=30, **kwargs)

    def operations(self) -> list[tuple[str, str, dict[str, Any]]]:
        return [
            (method.upper(), path, operation)
            for path, operations in self.schema["paths"].items()
            for method, operation in operations.items()
            if path not in PUBLIC_PATHS
        ]


@pytest.fixture
def tenants(
    postgres_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> Iterator[Tenants]:
    with start_collector(postgres_url, dashboard=False, admin_token=ADMIN, auth="token") as live:
        yield Tenants(live.url, postgres_url)


def _ids_in(value: Any) -> Iterator[Any]:
    """Every `id` of an object in a list, anywhere in a JSON answer."""
    if isinstance(value, dict):
        if "id" in value and isinstance(value["id"], (int, str)):
            yield value["id"]
        for item in value.values():
            yield from _ids_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from _ids_in(item)


def _foreign_object_id(tenants: Tenants, path: str, param: str) -> Any:
    """An id for `{param}` that belongs to the other tenant: the first object its token
    lists under the collection above the parameter (e.g. GET /webhooks for /webhooks/{id})."""
    collection = path.split("{" + param + "}")[0].rstrip("/")
    collection = collection.replace("{run_id}", str(tenants.run_ids[THEIRS["project"]]))
    if "{" in collection:
        return None
    answer = tenants.call("GET", collection, tenants.theirs)
    if answer.status_code != 200:
        return None
    found = list(_ids_in(answer.json()))
    return found[0] if found else None


def _foreign_request(
    tenants: Tenants, method: str, path: str, operation: dict[str, Any]
) -> dict[str, Any] | None:
    """A request through this operation aimed at the other tenant's data, or None when the
    operation takes neither a run, a project nor an object the other tenant owns."""
    params = {p["name"]: p for p in operation.get("parameters", [])}
    aimed = False
    url = path
    for name, param in params.items():
        if param.get("in") != "path":
            continue
        if name == "run_id":
            value: Any = tenants.run_ids[THEIRS["project"]]
        elif name == "project":
            value = THEIRS["project"]
        elif name == "layer":
            value = THEIRS["layer"]
        else:
            value = _foreign_object_id(tenants, path, name)
            if value is None:
                return None  # the other tenant owns no such object: nothing to aim at
        url = url.replace("{" + name + "}", str(value))
        aimed = True
    query = {}
    if "project" in params and params["project"].get("in") == "query":
        query["project"] = THEIRS["project"]
        aimed = True
    request: dict[str, Any] = {"method": method, "path": url, "params": query}
    if path == INGEST_PATH:
        request["json"] = batch(THEIRS, seq=7)
        return request
    body_schema = (
        operation.get("requestBody", {}).get("content", {}).get("application/json", {})
        .get("schema", {})
    )  # fmt: skip
    ref = body_schema.get("$ref", "")
    properties = (
        tenants.schema["components"]["schemas"][ref.rsplit("/", 1)[-1]].get("properties", {})
        if ref
        else body_schema.get("properties", {})
    )
    if "requestBody" in operation:  # a valid body, so that only the tenancy can refuse it
        body = _example(tenants.schema, body_schema)
        if "project" in properties:
            body["project"] = THEIRS["project"]
            aimed = True
        if "client_run_id" in properties:
            body.update(client_run_id=THEIRS["run"], name="stolen")
        request["json"] = body
    return request if aimed else None


def _example(document: dict[str, Any], schema: dict[str, Any]) -> Any:
    """A minimal valid value for a JSON schema: required properties only."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return _example(document, document["components"]["schemas"][name])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            options = [o for o in schema[key] if o.get("type") != "null"] or schema[key]
            return _example(document, options[0])
    if "default" in schema:
        return schema["default"]
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        return {
            name: _example(document, schema["properties"][name])
            for name in schema.get("required", [])
        }
    if kind == "string":
        if schema.get("format") == "uri" or "url" in str(schema.get("title", "")).lower():
            return "https://hooks.example.com/ampwatch"
        return "x" * max(1, schema.get("minLength", 1))
    if kind == "integer":
        return max(1, schema.get("minimum", 1))
    if kind == "number":
        return float(max(1, schema.get("minimum", 1)))
    if kind == "boolean":
        return False
    if kind == "array":
        return []
    return None


@pytest.mark.postgres
def test_a_project_token_cannot_touch_another_projects_data_on_any_route(
    tenants: Tenants, postgres_url: str
) -> None:
    rows = RowCounter(postgres_url)
    try:
        _check_every_route(tenants, rows)
    finally:
        rows.close()


def _check_every_route(tenants: Tenants, rows: RowCounter) -> None:
    checked: list[str] = []
    not_aimed: list[str] = []
    for method, path, operation in tenants.operations():
        request = _foreign_request(tenants, method, path, operation)
        if request is None:
            not_aimed.append(f"{method} {path}")
            continue
        before = rows.counts()
        method_, url = request.pop("method"), request.pop("path")
        answer = tenants.call(method_, url, tenants.mine, **request)
        assert answer.status_code in (403, 404), (method, path, answer.status_code, answer.text)
        assert rows.counts() == before, f"{method} {path}: a refused request wrote"
        for marker in (THEIRS["run"], THEIRS["layer"], f"/ckpt/{THEIRS['run']}"):
            assert marker not in answer.text, (method, path, answer.text)
        if method != "DELETE":  # control: the owner is let through (no 401/403)
            own = tenants.call(method_, url, tenants.theirs, **request)
            if path != "/metrics":
                assert own.status_code not in (401, 403), (method, path, own.text)
        checked.append(f"{method} {path}")
    # The routes that name no run, project or foreign object: their answers to one tenant
    # must hold nothing of the other's (lists, searches, metrics).
    for method, path, _operation in tenants.operations():
        if method == "GET" and "{" not in path:
            answer = tenants.call(method, path, tenants.mine)
            for marker in THEIRS.values():
                assert marker not in answer.text, (path, marker)
    assert any("{run_id}" in route for route in checked)
    record_figure(
        "tenancy",
        f"{len(checked)} operations refused a foreign token (403/404, nothing written, "
        f"no foreign data in the answer); {len(not_aimed)} take no run/project/object "
        f"(checked for leaks instead): {', '.join(not_aimed)}",
    )


@pytest.mark.postgres
def test_tokens_are_hashed_at_rest(tenants: Tenants, postgres_url: str) -> None:
    engine = make_engine(postgres_url)
    with engine.connect() as connection:
        stored = list(connection.execute(select(Token.prefix, Token.secret_hash)))
    engine.dispose()
    assert len(stored) == 2
    for prefix, secret_hash in stored:
        token = tenants.mine if prefix in tenants.mine else tenants.theirs
        assert secret_hash == hashlib.sha256(token.encode()).hexdigest()
        assert token not in secret_hash and token.rsplit("_", 1)[-1] not in secret_hash


_SQL_SINKS = {"text", "exec_driver_sql", "execute", "executemany", "literal_column"}


def _builds_a_string(node: ast.AST) -> bool:
    """f-strings, concatenation, %-formatting, .format(): a string computed at run time."""
    if isinstance(node, ast.JoinedStr):
        return any(isinstance(v, ast.FormattedValue) for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        return isinstance(node.left, (ast.Constant, ast.JoinedStr, ast.BinOp)) and (
            not isinstance(node.left, ast.Constant) or isinstance(node.left.value, str)
        )
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "format"
    )


#: Strings formatted from constants, not from data: (file, source of the argument).
_CONSTANT_TEMPLATES = {
    # a module constant (an int) in a PRAGMA, which takes no bound parameter
    ("server/db.py", 'f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}"'),
    # the driver's placeholder mark ('?' or '%s') into a constant template; values bound
    ("server/layer_reads.py", 'sql.format("%s")'),
    ("server/layer_reads.py", "sql.format(mark)"),
}


def test_no_sql_is_built_from_strings() -> None:
    """No call into the database (text(), execute(), exec_driver_sql(), ...) in the
    collector takes a string computed at run time: values travel as bound parameters."""
    offenders = []
    files = sorted((ROOT / "server").rglob("*.py")) + sorted((ROOT / "alembic").rglob("*.py"))
    for file in files:
        tree = ast.parse(file.read_text(), filename=str(file))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in _SQL_SINKS and _builds_a_string(node.args[0]):
                where = str(file.relative_to(ROOT))
                source = ast.get_source_segment(file.read_text(), node.args[0])
                if (where, source) not in _CONSTANT_TEMPLATES:
                    offenders.append(f"{where}:{node.lineno}: {source}")
    assert not offenders, offenders
    record_figure("sql", f"{len(files)} files scanned: no SQL built from strings")


def test_cors_is_closed_by_default_and_opens_only_to_named_origins(
    sqlite_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> None:
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "GET",
                 "Access-Control-Request-Headers": "authorization"}  # fmt: skip
    with start_collector(sqlite_url, dashboard=False) as live:
        answer = httpx.options(f"{live.url}/api/v1/runs", headers=preflight, timeout=10)
        assert "access-control-allow-origin" not in answer.headers
        simple = httpx.get(
            f"{live.url}/api/v1/runs", headers={"Origin": "https://evil.example"}, timeout=10
        )
        assert "access-control-allow-origin" not in simple.headers
    with start_collector(sqlite_url, dashboard=False, cors_origins=["https://ops.example"]) as live:
        evil = httpx.options(f"{live.url}/api/v1/runs", headers=preflight, timeout=10)
        assert evil.headers.get("access-control-allow-origin") != "https://evil.example"
        ok = httpx.options(
            f"{live.url}/api/v1/runs",
            headers={**preflight, "Origin": "https://ops.example"},
            timeout=10,
        )
        assert ok.headers.get("access-control-allow-origin") == "https://ops.example"


def _dash_request(dependency: dict[str, Any]) -> dict[str, Any] | None:
    """A `_dash-update-component` call firing this callback with default inputs."""
    output = dependency["output"]
    if "{" in output:
        return None  # pattern-matching ids: skip
    if output.startswith(".."):
        parts = list(output.strip(".").split("..."))
    else:
        parts = [output]
    outputs = [dict(zip(("id", "property"), part.rsplit(".", 1), strict=True)) for part in parts]

    def values(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            {**item, "value": 1 if item["property"] == "n_intervals" else None} for item in items
        ]

    inputs = values(dependency["inputs"])
    return {
        "output": output,
        "outputs": outputs if output.startswith("..") else outputs[0],
        "inputs": inputs,
        "state": values(dependency.get("state", [])),
        "changedPropIds": [f"{i['id']}.{i['property']}" for i in inputs[:1]],
    }


@pytest.mark.postgres
def test_the_dashboard_shows_only_what_its_token_may_read(
    tenants: Tenants, dashboard_process: Callable[..., str]
) -> None:
    """The standalone dashboard with tenant A's token: every callback it has (its real
    Dash callbacks over HTTP, fired with default inputs) answers with A's run and never
    with anything of B's; B's run through the dashboard's client is refused."""
    dashboard = dashboard_process(tenants.url, tenants.mine)
    dependencies = httpx.get(f"{dashboard}/_dash-dependencies", timeout=30).json()
    answered = []
    for dependency in dependencies:
        request = _dash_request(dependency)
        if request is None:
            continue
        answer = httpx.post(f"{dashboard}/_dash-update-component", json=request, timeout=30)
        if answer.status_code == 200:
            answered.append(answer.text)
        for marker in THEIRS.values():
            assert marker not in answer.text, (dependency["output"], marker)
    assert any(MINE["run"] in text for text in answered), "the dashboard never listed A's run"
    # Also for B's run page: nothing of B's in any callback fired at /run/<B's id>.
    from ampwatch.dashboard.client import CollectorClient, CollectorError

    client = CollectorClient(tenants.url, token=tenants.mine)
    with pytest.raises(CollectorError):
        client.get_run(tenants.run_ids[THEIRS["project"]])
    record_figure(
        "dashboard",
        f"{len(dependencies)} callbacks fired with tenant A's token: A's run shown, "
        "nothing of tenant B's",
    )
