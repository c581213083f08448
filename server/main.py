"""The collector's FastAPI application.

>>> app = create_app(Settings(database_url="sqlite:///ampwatch.db", dashboard=False))
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import RedirectResponse

from ampwatch.server.api import health, ingest, runs
from ampwatch.server.db import make_engine, make_sessionmaker
from ampwatch.server.settings import Settings

API_PREFIX = "/api/v1"
DASHBOARD_PATH = "/dashboard"


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the collector for `settings` (default: from `AMPWATCH_*` variables).

    The database schema is not created here: apply migrations first
    (`ampwatch.server.migrate.upgrade`), as `ampwatch serve` does.
    """
    settings = settings or Settings()
    engine = make_engine(settings.database_url)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.dispose()

    app = FastAPI(title="ampwatch collector", version="1", lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessionmaker = make_sessionmaker(engine)
    app.include_router(health.router)
    app.include_router(ingest.router, prefix=API_PREFIX)
    app.include_router(runs.router, prefix=API_PREFIX)
    if settings.dashboard:
        _mount_dashboard(app, settings)
    return app


def _mount_dashboard(app: FastAPI, settings: Settings) -> None:
    # Imported here: Dash is heavy, and a collector started with dashboard=False
    # (docker-compose runs the dashboard as its own process) never needs it.
    from a2wsgi import WSGIMiddleware

    from ampwatch.dashboard.app import create_dash_app

    dash = create_dash_app(
        api_url=settings.public_url, requests_pathname_prefix=f"{DASHBOARD_PATH}/"
    )
    app.mount(DASHBOARD_PATH, WSGIMiddleware(dash.server))  # type: ignore[arg-type]

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse(f"{DASHBOARD_PATH}/")
