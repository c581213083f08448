from __future__ import annotations

from typing import Any

import dash
import pytest

from ampwatch.dashboard.__main__ import main


def test_main_serves_the_app_for_the_given_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    served: dict[str, Any] = {}

    def fake_run(app: dash.Dash, **kwargs: Any) -> None:
        served.update(kwargs, prefix=app.config.requests_pathname_prefix)

    monkeypatch.setattr(dash.Dash, "run", fake_run)
    main(["--api-url", "http://collector:8000", "--port", "8123", "--host", "0.0.0.0"])
    assert served == {"host": "0.0.0.0", "port": 8123, "debug": False, "prefix": "/"}


def test_main_requires_the_collector_url() -> None:
    with pytest.raises(SystemExit):
        main([])


def test_main_passes_the_token_from_flag_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import ampwatch.dashboard.__main__ as entry

    tokens: list[str | None] = []

    class NotServed:
        def run(self, **_: Any) -> None:
            pass

    def capture(api_url: str, **kwargs: Any) -> NotServed:
        tokens.append(kwargs.get("token"))
        return NotServed()

    monkeypatch.setattr(entry, "create_dash_app", capture)
    monkeypatch.setenv("AMPWATCH_DASHBOARD_TOKEN", "aw_env")
    main(["--api-url", "http://c"])
    main(["--api-url", "http://c", "--token", "aw_flag"])
    assert tokens == ["aw_env", "aw_flag"]
