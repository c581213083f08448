"""The collector's FastAPI application.

>>> app = create_app(Settings(database_url="sqlite:///ampwatch.db", dashboard=False))
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio.to_thread
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException

from ampwatch.agent.wire import API_PREFIX, DASHBOARD_PREFIX, INGEST_PATH
from ampwatch.server import auth, errors, heap, metrics, migrate
from ampwatch.server.admission import AdmissionLimit
from ampwatch.server.api import (
    advisor,
    alerts,
    conditional,
    fp8,
    health,
    ingest,
    resume_plan,
    run_data,
    runs,
    webhooks,
)
from ampwatch.server.api import metrics as metrics_api
from ampwatch.server.api.deps import AUTH_ERRORS, get_principal
from ampwatch.server.body_limit import BodyLimit
from ampwatch.server.db import lookup_connections, make_engine, make_sessionmaker
from ampwatch.server.ingest_pool import IngestPool, yield_cpu_to_ingest
from ampwatch.server.origin import LocalTrustGuard
from ampwatch.server.settings import Settings


def create_app(settings: Settings | None = None, *, freeze_heap: bool = True) -> FastAPI:
    """Build the collector for `settings` (default: from `AMPWATCH_*` variables);
    `freeze_heap`: keep its start-up heap out of full collections while serving (`heap.py`).

    The database schema is not created here: apply migrations first
    (`ampwatch.server.migrate.upgrade`), as `ampwatch serve` does. Startup fails when
    the collector would listen beyond loopback with no token (`auth.check_exposure`).
    """
    settings = settings or Settings()
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # The limiter belongs to this event loop: the threads that run sync endpoints.
        # Reads and ingest each hold at most their lane's share of it (`admission.py`).
        threads = settings.worker_threads + settings.ingest_threads
        anyio.to_thread.current_default_thread_limiter().total_tokens = threads
        with sessions() as session:
            auth.check_exposure(session, settings)
        # Batches are stored, their alerts judged and delivered, by the ingest process.
        _app.state.ingest_pool = pool = IngestPool(settings)
        yield_cpu_to_ingest(settings.read_niceness, await pool.started())
        try:
            if freeze_heap:
                with heap.startup_heap_frozen():
                    yield
            else:
                yield
        finally:
            await anyio.to_thread.run_sync(pool.close)
            engine.dispose()

    app = FastAPI(title="ampwatch collector", version="1", lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessionmaker = sessions
    app.state.lookup_connections = lookup_connections(engine)
    app.state.migration_head = migrate.head_revision()
    app.state.ingest_counters = metrics.IngestCounters(settings.metrics_dir)
    # Inside CountRejections: an ingest body refused for its size is counted.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(
        metrics.CountRejections, path=INGEST_PATH, counters=app.state.ingest_counters
    )
    if settings.cors_origins:  # closed by default: no CORS headers, no cross-site reads
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "Content-Encoding"],
        )
    app.add_exception_handler(auth.AuthError, _auth_error)
    app.add_exception_handler(RequestValidationError, errors.validation_error)
    app.add_exception_handler(HTTPException, errors.http_error)
    for busy in (OperationalError, PoolTimeout):
        app.add_exception_handler(busy, errors.database_busy)
    app.add_middleware(errors.RejectNul)
    app.add_middleware(LocalTrustGuard, settings=settings)
    app.include_router(health.router)
    # Every API route needs a caller (`ampwatch.server.auth`), checked before its body is read
    # (`deps.SessionRoute`).
    guard = [Depends(get_principal)]
    app.include_router(metrics_api.router, dependencies=guard, responses=AUTH_ERRORS)
    for api in (ingest, runs, run_data, webhooks, advisor, resume_plan, fp8):
        app.include_router(api.router, prefix=API_PREFIX, dependencies=guard, responses=AUTH_ERRORS)
    # The routes + the alerts file.
    alerts.mount(app, prefix=API_PREFIX, dependencies=guard, responses=AUTH_ERRORS)
    app.state.tagged_answers = conditional.TaggedAnswers()
    app.state.answer_tag = conditional.answer_tag(
        app.state.migration_head, app.state.sessionmaker.kw["info"]
    )
    if settings.dashboard:
        _mount_dashboard(app, settings)
    # Added last, so outermost: a request waits for its turn before any other work.
    app.add_middleware(
        AdmissionLimit,
        reads=settings.worker_threads,
        ingests=settings.ingest_in_flight,
        unqueued_mount=DASHBOARD_PREFIX,
    )
    return app


def _auth_error(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, auth.AuthError)  # registered for it alone
    # RFC 6750: a 401 names the scheme the client should use.
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(
        {"detail": errors.bounded_message(error.message)}, status_code=error.status, headers=headers
    )


def _mount_dashboard(app: FastAPI, settings: Settings) -> None:
    # Imported here: Dash is heavy, and a collector started with dashboard=False
    # (docker-compose runs the dashboard as its own process) never needs it.
    from a2wsgi import WSGIMiddleware
    from starlette.middleware.gzip import GZipMiddleware

    from ampwatch.dashboard.app import create_dash_app

    token = settings.dashboard_token
    dash = create_dash_app(
        api_url=settings.public_url,
        requests_pathname_prefix=f"{DASHBOARD_PREFIX}/",
        token=token.get_secret_value() if token is not None else None,
    )
    # Compressed for a browser across a network (an SSH tunnel to the cluster, say): a
    # first visit's 2.7 MB of scripts and ~0.9 MB of page data shrink to about a third.
    # Level 1: ~10 ms of server CPU per MB; higher levels cost 3x for a few percent more.
    app.mount(
        DASHBOARD_PREFIX,
        # a2wsgi's ASGI types are stricter than starlette's callable protocol, same shape.
        GZipMiddleware(WSGIMiddleware(dash.server), minimum_size=1024, compresslevel=1),  # type: ignore[arg-type]
    )

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse(f"{DASHBOARD_PREFIX}/")
