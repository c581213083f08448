"""`GET /metrics`: Prometheus scrape target (series: `ampwatch.server.metrics`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from ampwatch.server import metrics
from ampwatch.server.api.deps import (
    NOT_YOURS,
    PrincipalDep,
    SessionDep,
    SessionRoute,
    SettingsDep,
)
from ampwatch.server.auth import ACCESS_EXTRA
from ampwatch.server.exposition import CONTENT_TYPE
from ampwatch.server.models import utcnow

router = APIRouter(route_class=SessionRoute, tags=["metrics"])


@router.get(
    "/metrics",
    # No response_class: it would document the JSON 401/403 answers as text/plain too.
    responses={200: {"content": {CONTENT_TYPE: {}}}, **NOT_YOURS},
    openapi_extra={ACCESS_EXTRA: "metrics"},  # a `metrics` token may call it (auth.GRANTS)
)
def scrape(
    request: Request, session: SessionDep, principal: PrincipalDep, settings: SettingsDep
) -> PlainTextResponse:
    """Prometheus series: a token of a project (any scope; `metrics` is enough) gets that
    project's; a token for every project also gets this process's ingest counters."""
    text = metrics.render(
        session,
        request.app.state.ingest_counters,
        now=utcnow(),
        ended_window=settings.metrics_ended_window,
        max_runs=settings.metrics_max_runs,
        project=principal.project,
    )
    return PlainTextResponse(text, media_type=CONTENT_TYPE)
