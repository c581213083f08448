"""Settings defaults, environment overrides and the derived public URL."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ampwatch.server.db import make_engine
from ampwatch.server.packed import pack_row, to_wire_rows, unpack_matrix
from ampwatch.server.settings import Settings


def test_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    settings = Settings()
    assert settings.database_url == f"sqlite:///{tmp_path}/.ampwatch/ampwatch.db"
    assert (settings.host, settings.port, settings.dashboard) == ("127.0.0.1", 8765, True)
    assert settings.public_url == "http://127.0.0.1:8765"
    make_engine(settings.database_url).dispose()
    assert (tmp_path / ".ampwatch").is_dir()  # created when the engine is made


def test_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMPWATCH_DATABASE_URL", "postgresql+psycopg://db/ampwatch")
    monkeypatch.setenv("AMPWATCH_PORT", "9000")
    monkeypatch.setenv("AMPWATCH_DASHBOARD", "false")
    settings = Settings()
    assert settings.database_url == "postgresql+psycopg://db/ampwatch"
    assert settings.port == 9000
    assert settings.dashboard is False


@pytest.mark.parametrize(
    ("host", "public_url", "expected"),
    [
        ("0.0.0.0", "", "http://127.0.0.1:8765"),  # a wildcard bind is not dialable
        ("::1", "", "http://[::1]:8765"),
        ("10.0.0.5", "", "http://10.0.0.5:8765"),
        ("0.0.0.0", "https://watch.example.com/", "https://watch.example.com"),
    ],
)
def test_public_url(host: str, public_url: str, expected: str) -> None:
    assert Settings(host=host, public_url=public_url).public_url == expected


def test_packed_rows_keep_missing_apart_from_nan() -> None:
    short = pack_row(2, [(np.array([1]), np.array([np.nan]))])
    full = pack_row(3, [(np.array([0, 2]), np.array([0.5, -np.inf]))])
    values, missing = unpack_matrix([short, full], 3)
    assert missing.tolist() == [[True, False, True], [False, True, False]]
    assert to_wire_rows(values, missing) == [[None, "NaN", None], [0.5, None, "-Infinity"]]
