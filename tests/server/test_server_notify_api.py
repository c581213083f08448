"""`/api/v1/webhooks` with tokens: each project manages only its own webhooks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest

from ampwatch.server.auth import create_token
from ampwatch.server.cli import main
from ampwatch.server.db import make_engine, make_sessionmaker

ADMIN = "admin-token-for-tests-0123456789"


@pytest.fixture
def secured(
    db_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> Iterator[tuple[Any, dict[str, httpx.Client]]]:
    """A collector that needs tokens, and a client per caller: admin, vision, audio."""
    with start_collector(db_url, dashboard=False, admin_token=ADMIN) as live:
        engine = make_engine(live.database_url)
        with make_sessionmaker(engine)() as session:
            tokens = {p: create_token(session, project=p).token for p in ("vision", "audio")}
        engine.dispose()
        tokens["admin"] = ADMIN
        clients = {
            who: httpx.Client(
                base_url=f"{live.url}/api/v1",
                headers={"Authorization": f"Bearer {token}"},
                timeout=30,
            )
            for who, token in tokens.items()
        }
        try:
            yield live, clients
        finally:
            for client in clients.values():
                client.close()


def test_project_tokens_manage_only_their_webhooks(
    secured: tuple[Any, dict[str, httpx.Client]],
) -> None:
    live, as_ = secured
    vision = as_["vision"].post("/webhooks", json={"url": "https://hooks.example/v"})
    assert vision.status_code == 201, vision.text
    assert vision.json()["project"] == "vision"  # a project token's default: its own
    assert vision.json()["min_severity"] == "warning"
    assert vision.json()["format"] == "generic"
    hook = vision.json()["id"]
    everyone = (
        as_["admin"]
        .post("/webhooks", json={"url": "http://chat.example/all", "format": "slack"})
        .json()
    )
    assert everyone["project"] is None
    audio = (
        as_["admin"]
        .post(
            "/webhooks",
            json={"url": "http://chat.example/a", "project": "audio", "min_severity": "critical"},
        )
        .json()
    )
    assert audio["project"] == "audio"

    def ids(who: str, **params: str) -> list[int]:
        response = as_[who].get("/webhooks", params=params)
        assert response.status_code == 200, response.text
        return [w["id"] for w in response.json()["webhooks"]]

    assert ids("vision") == [hook]
    assert ids("audio") == [audio["id"]]
    assert ids("admin") == [hook, everyone["id"], audio["id"]]
    assert ids("admin", project="audio") == [audio["id"]]
    assert as_["vision"].get("/webhooks", params={"project": "audio"}).status_code == 403

    # Another project's webhook, or the admin's global one: neither seen nor touched.
    denied = as_["vision"].post("/webhooks", json={"url": "https://x.example/", "project": "audio"})
    assert denied.status_code == 403
    assert "cannot access another project's data" in denied.json()["detail"]
    for path in (f"/webhooks/{hook}", f"/webhooks/{everyone['id']}"):
        assert as_["audio"].delete(path).status_code == 403
        assert as_["audio"].get(f"{path}/deliveries").status_code == 403
        assert as_["audio"].post(f"{path}/test").status_code == 403
    assert as_["vision"].get(f"/webhooks/{hook}/deliveries").json() == {"deliveries": []}
    assert as_["vision"].delete("/webhooks/999999").status_code == 404
    assert as_["vision"].delete(f"/webhooks/{hook}").status_code == 204
    assert ids("admin") == [everyone["id"], audio["id"]]
    anonymous = httpx.post(f"{live.url}/api/v1/webhooks", json={"url": "http://a.example/"})
    assert anonymous.status_code == 401


#: Bodies a webhook is refused for, with what the 422 names.
INVALID = [
    ({"url": "ftp://files.example/hook"}, "http:// or https://"),
    ({"url": "https:///no-host"}, "http:// or https://"),
    ({"url": "not a url"}, "http:// or https://"),
    ({"url": "http://h.example/a b"}, "spaces"),
    ({"url": "http://h.example:99999/"}, "not a valid URL"),
    ({"url": "https://h.example/" + "x" * 2048}, "longer than 2048"),
    ({"url": "https://h.example/", "format": "teams"}, "format"),
    ({"url": "https://h.example/", "min_severity": "page"}, "min_severity"),
    ({"url": "https://h.example/", "secret": "x"}, "secret"),
]


def test_webhook_urls_and_fields_are_validated(
    secured: tuple[Any, dict[str, httpx.Client]],
) -> None:
    for body, message in INVALID:
        response = secured[1]["admin"].post("/webhooks", json=body)
        assert response.status_code == 422, body
        assert message in response.text, (body, response.text)
    assert secured[1]["admin"].get("/webhooks").json() == {"webhooks": []}


def test_webhook_cli(
    secured: tuple[Any, dict[str, httpx.Client]], capsys: pytest.CaptureFixture[str]
) -> None:
    live, _ = secured
    connect = ["--url", live.url, "--token", ADMIN]
    assert (
        main(
            [
                "webhook",
                "add",
                "https://hooks.example/x",
                "--format",
                "slack",
                "--project",
                "vision",
                *connect,
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == "webhook 1 added: slack -> https://hooks.example/x\n"
    assert main(["webhook", "list", *connect]) == 0
    assert capsys.readouterr().out == "1  vision  slack  >=warning  https://hooks.example/x\n"
    assert main(["webhook", "remove", "1", *connect]) == 0
    assert main(["webhook", "remove", "1", *connect]) == 1
    assert "HTTP 404: webhook 1 not found" in capsys.readouterr().err
    assert main(["webhook", "add", "ftp://x", *connect]) == 1
