"""Collector settings: one class, read from `AMPWATCH_*` environment variables.

Tests and the CLI construct `Settings(...)` with keyword overrides instead of touching the
environment, so every knob has exactly one home.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

#: An allow-listed network; "127.0.0.1" alone means 127.0.0.1/32.
IPNetwork = Annotated[
    ipaddress.IPv4Network | ipaddress.IPv6Network,
    BeforeValidator(
        lambda value: ipaddress.ip_network(value, strict=False) if isinstance(value, str) else value
    ),
]

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
    >>> Settings(database_url="postgresql+psycopg://db/ampwatch").ingest_processes
    2
    """

    model_config = SettingsConfigDict(env_prefix="AMPWATCH_", extra="forbid")

    database_url: str = Field(
        default_factory=default_database_url,
        description="SQLAlchemy URL: sqlite:///path.db (default) or postgresql+psycopg://...",
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8765, ge=0, le=65535)
    workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Collector processes sharing the port (`ampwatch serve`); more than one "
        "needs PostgreSQL.",
    )
    migrate: bool = Field(
        default=True,
        description="Apply migrations when `ampwatch serve` starts; false where several "
        "collectors share a database and `ampwatch db upgrade` runs once beforehand.",
    )
    public_url: str = Field(
        default="",
        description="Base URL at which the dashboard reaches this collector's API; "
        "derived from host and port when empty.",
    )
    dashboard: bool = Field(default=True, description="Mount the Dash app at /dashboard/.")
    worker_threads: int = Field(
        default=2,
        ge=1,
        le=256,
        description="Threads per collector process that run API reads, which are admitted "
        "as many at a time (the rest wait their turn, never refused; `server/admission.py`); "
        "ingest has ingest_threads of its own. anyio's default is 40. More threads only "
        "queue for the GIL: with 40 busy ones the event loop waited "
        "~300 ms for its turn, so /healthz answered in 365 ms at p99 under 1,000 clients; "
        "4 instead of 8 took bench/load.py's /healthz p99 from 57-82 to 37-56 ms; 2 instead "
        "of 4, alternated, reads from 668 / 629 to 701 / 690 a second on SQLite and from "
        "201 / 201 to 229 / 216 on PostgreSQL (two workers), /healthz p99 no worse.",
    )
    request_head_timeout: float = Field(
        default=10.0,
        gt=0,
        description="Seconds a connection may take to send a request's headers, after "
        "opening or after its previous answer; then it is closed (`server/connections.py`; "
        "also uvicorn's keep-alive timeout).",
    )
    ingest_threads: int = Field(
        default=2,
        ge=1,
        le=256,
        description="Threads per collector process kept for ingest, besides worker_threads "
        "(which serve reads): a batch's caller is resolved on one, never behind reads "
        "(`server/admission.py`).",
    )
    ingest_in_flight: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="Batches per collector process taken in at once: read, and waiting for "
        "or in an ingest process (`server/admission.py`); each one's body is in memory (at "
        "most max_body_bytes). More wait, unread, in their connections.",
    )
    ingest_processes: int = Field(
        default=0,
        ge=0,
        le=64,
        description="Processes per collector process that store ingest batches "
        "(`server/ingest_pool.py`), so that a batch never shares a GIL with reads. 0 "
        "(default): 1 on SQLite, which has one writer at a time; 2 on PostgreSQL, where a "
        "process spends most of a batch waiting for the server (one stored ~19 of 32 agents' "
        "batches a second under bench/load.py, two all 32).",
    )
    read_niceness: int = Field(
        default=10,
        ge=0,
        le=19,
        description="How much lower than its ingest processes' the CPU priority of the "
        "collector's process, which serves reads, runs (nice): on a busy machine batches and "
        "their alerts come first (`ingest_pool.yield_cpu_to_ingest`); 0: the same.",
    )
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
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Browser origins allowed to call the API cross-site (JSON list or "
        "comma-separated). Empty (the default): no CORS headers, so browsers refuse "
        "cross-origin reads.",
    )
    alerts_file: Path | None = Field(
        default=None,
        description="TOML file of alert thresholds: [rules.<rule>] and "
        "[projects.<project>.rules.<rule>] sections (README, 'Alert rules').",
    )
    assets_dir: Path | None = Field(
        default=None,
        description="Folder of fetched browser assets (`ampwatch fetch-plotly`); default: "
        "<python prefix>/share/ampwatch, so a fresh venv starts without stale files.",
    )
    dashboard_token: SecretStr | None = Field(
        default=None,
        description="Token the mounted dashboard sends to this collector's API; whoever "
        "can open /dashboard/ sees what this token may read.",
    )

    dashboard_url: str = Field(
        default="",
        description="Base URL of the dashboard as people open it, for links in webhook "
        "messages; default: the mounted one, public_url + /dashboard (set it when the "
        "dashboard runs on its own, e.g. http://host:8050).",
    )
    metrics_ended_window: float = Field(
        default=3600.0,
        ge=0,
        description="Seconds an ended run keeps its per-run series on /metrics after its "
        "last data (running runs always have them).",
    )
    metrics_dir: Path | None = Field(
        default=None,
        description="Folder in which each worker process of the collector keeps its ingest "
        "counters (a small file per process), summed by whichever worker answers /metrics. "
        "Unset: `ampwatch serve` with several workers makes a fresh one; one process counts "
        "in memory.",
    )
    metrics_max_runs: int = Field(
        default=2000,
        ge=0,
        le=10_000,  # their ids travel as bound parameters (SQLite allows 32,766)
        description="Most runs with per-run series on /metrics (~11 series each): running "
        "runs first, then the most recently seen; ampwatch_metrics_runs_omitted counts the "
        "rest.",
    )
    notify_interval: float = Field(
        default=1.0,
        gt=0,
        description="Seconds between the notification worker's alert sweeps, and between "
        "its rounds of webhook delivery when no batch wakes it sooner.",
    )
    webhook_timeout: float = Field(
        default=5.0,
        gt=0,
        description="Seconds one webhook delivery may take in all (connect, send, answer).",
    )
    webhook_allowed_networks: Annotated[list[IPNetwork], NoDecode] = Field(
        default_factory=list,
        description="Networks (CIDR, or single addresses) webhooks may reach although they "
        "are loopback, private or link-local, e.g. 10.20.0.0/16 for an in-house receiver "
        "(JSON list or comma-separated). Empty (the default): webhooks reach public "
        "addresses only, so a tenant cannot make the collector call inside its network.",
    )
    layer_raw_keep_steps: int | None = Field(
        default=None,
        ge=64,
        description="Age raw layer samples into the layer rollups (`ampwatch age-layer-stats`) "
        "for runs whose samples span more than this many steps, keeping the last this many "
        "steps raw; older spans stay readable in 64-step buckets. None (the default): keep "
        "every raw sample.",
    )
    webhook_max_attempts: int = Field(
        default=8, ge=1, description="Deliveries tried per notification before it is failed."
    )
    webhook_retry_base: float = Field(
        default=5.0,
        gt=0,
        description="Seconds before the first retry of a failed delivery; doubles per "
        "attempt (with jitter, capped at 15 minutes).",
    )

    @field_validator("cors_origins", "webhook_allowed_networks", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        if isinstance(value, str):  # AMPWATCH_CORS_ORIGINS etc.: a JSON list or "a,b"
            text = value.strip()
            if text.startswith("["):
                import json

                return json.loads(text)
            return [origin.strip() for origin in text.split(",") if origin.strip()]
        return value

    @model_validator(mode="after")
    def _derive_defaults(self) -> Settings:
        if not self.public_url:
            host = "127.0.0.1" if self.host in _WILDCARD_HOSTS else self.host
            if ":" in host:  # a bare IPv6 address needs brackets in a URL
                host = f"[{host}]"
            self.public_url = f"http://{host}:{self.port}"
        self.public_url = self.public_url.rstrip("/")
        if not self.ingest_processes:
            self.ingest_processes = 1 if self.database_url.startswith("sqlite") else 2
        return self
