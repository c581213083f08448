"""Probes: `/healthz` (liveness: the process answers) and `/readyz` (readiness: it can
serve, meaning the database answers and its schema is at this code's migration head).

Load balancers and orchestrators route traffic by `/readyz` and restart by `/healthz`;
keeping the database out of liveness stops a database outage from restarting every
collector. The agent's startup check uses `/healthz`. Neither needs a token.
"""

from __future__ import annotations

from alembic.migration import MigrationContext
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    # async: answered on the event loop, never queued behind busy worker threads
    return {"status": "ok"}


@router.get(
    "/readyz",
    responses={503: {"description": "Database unreachable or not migrated to head"}},
)
def readyz(request: Request) -> JSONResponse:
    head: str = request.app.state.migration_head
    try:
        with request.app.state.engine.connect() as connection:
            current = MigrationContext.configure(connection).get_current_revision()
    except SQLAlchemyError as error:
        detail = f"database unreachable: {type(error).__name__}: {str(error).splitlines()[0]}"
        return JSONResponse({"status": "unavailable", "detail": detail}, status_code=503)
    if current != head:
        detail = (
            f"database schema at {current}, this collector needs {head}: run ampwatch db upgrade"
        )
        return JSONResponse({"status": "unavailable", "detail": detail}, status_code=503)
    return JSONResponse({"status": "ready", "revision": current})
