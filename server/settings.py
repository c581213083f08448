"""Collector settings: one class, read from `AMPWATCH_*` environment variables.

Tests and the CLI construct `Settings(...)` with keyword overrides instead of touching the
environment, so every knob has exactly one home.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: Hosts that mean "every interface" when binding but cannot be dialled as a destination.
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


def default_database_url() -> str:
    """An SQLite file under `./.ampwatch/`, so `ampwatch serve` needs nothing installed.

    The folder is created when the engine is made (`ampwatch.server.db.make_engine`).
    """
    return f"sqlite:///{Path.cwd() / '.ampwatch' / 'ampwatch.db'}"


class Settings(BaseSettings):
    """Everything the collector can be configured with.

    >>> Settings(database_url="sqlite:///:memory:", port=9000).public_url
    'http://127.0.0.1:9000'
    """

    model_config = SettingsConfigDict(env_prefix="AMPWATCH_", extra="forbid")

    database_url: str = Field(
        default_factory=default_database_url,
        description="SQLAlchemy URL: sqlite:///path.db (default) or postgresql+psycopg://...",
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8765, ge=0, le=65535)
    public_url: str = Field(
        default="",
        description="Base URL at which the dashboard reaches this collector's API; "
        "derived from host and port when empty.",
    )
    dashboard: bool = Field(default=True, description="Mount the Dash app at /dashboard/.")
    max_body_bytes: int = Field(
        default=32 * 1024 * 1024,
        gt=0,
        description="Largest ingest body accepted, compressed or decompressed (413 above).",
    )
    auth: Literal["auto", "open", "token"] = Field(
        default="auto",
        description="auto: open while no token exists and the collector listens on loopback "
        "only, token-checked otherwise; token: always checked; open: never checked "
        "(an explicit override, e.g. behind an authenticating proxy).",
    )
    admin_token: SecretStr | None = Field(
        default=None,
        min_length=16,  # it opens every project: no short, guessable ones
        description="A bearer token (16+ characters) that may read and write every project.",
    )
    dashboard_token: SecretStr | None = Field(
        default=None,
        description="Token the mounted dashboard sends to this collector's API; whoever "
        "can open /dashboard/ sees what this token may read.",
    )

    @model_validator(mode="after")
    def _derive_public_url(self) -> Settings:
        if not self.public_url:
            host = "127.0.0.1" if self.host in _WILDCARD_HOSTS else self.host
            if ":" in host:  # a bare IPv6 address needs brackets in a URL
                host = f"[{host}]"
            self.public_url = f"http://{host}:{self.port}"
        self.public_url = self.public_url.rstrip("/")
        return self
