"""`GET /metrics`: Prometheus scrape target (series: `ampwatch.server.metrics`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from ampwatch.server import metrics
from ampwatch.server.api.deps import NOT_YOURS, PrincipalDep, SessionDep
from ampwatch.server.auth import AuthError
from ampwatch.server.models import utcnow

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    # No response_class: it would document the JSON 401/403 answers as text/plain too.
    responses={200: {"content": {metrics.CONTENT_TYPE: {}}}, **NOT_YOURS},
)
def scrape(request: Request, session: SessionDep, principal: PrincipalDep) -> PlainTextResponse:
    """Collector-wide series; with tokens in use, scrape with the admin token."""
    if not principal.is_admin:
        raise AuthError(
            403,
            f"this token belongs to project {principal.project!r}; metrics cover every "
            "project, so scrape them with the admin token",
        )
    text = metrics.render(session, request.app.state.ingest_counters, now=utcnow())
    return PlainTextResponse(text, media_type=metrics.CONTENT_TYPE)
