"""`POST /api/v1/ingest`: the agent's only write path.

The caller is resolved first (`deps.SessionRoute`), then the body is read as sent (its size
bounded by `body_limit.BodyLimit`) and handed to the ingest process (`ingest_pool`), which
decodes, validates and stores it (`ingest_worker`): this process only relays, so a batch
never shares its GIL with the reads it serves. The body is read by hand rather than
declared as a pydantic parameter, because agents send it gzip-compressed
(`Content-Encoding: gzip`) and its size must be bounded both before and after
decompression. Every problem with the body is a 4xx that says what is wrong: 400 bad
gzip, 413 too large, 415 unknown encoding, 422 invalid batch.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from ampwatch.agent.wire import API_PREFIX, INGEST_PATH
from ampwatch.server import ingest_worker
from ampwatch.server.api.deps import NOT_YOURS, PrincipalDep, SessionRoute
from ampwatch.server.schemas.errors import ErrorPublic
from ampwatch.server.schemas.runs import IngestAck

router = APIRouter(route_class=SessionRoute, tags=["ingest"])


class IngestError(BaseModel):
    """A refused batch: `detail` says why (a list of field errors for an invalid batch)."""

    detail: str | list[dict[str, Any]]


#: Every refusal of the body is documented, so that clients (and the schema fuzzer) know them.
BODY_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorPublic, "description": "Content-Encoding gzip, but the body is not"},
    413: {"model": ErrorPublic, "description": "Body larger than AMPWATCH_MAX_BODY_BYTES"},
    415: {"model": ErrorPublic, "description": "A Content-Encoding other than gzip"},
    422: {"model": IngestError, "description": "Not JSON, or not a valid wire batch"},
}


@router.post(
    INGEST_PATH.removeprefix(API_PREFIX),
    response_model=IngestAck,
    responses={**NOT_YOURS, **BODY_ERRORS},
)
async def ingest(request: Request, principal: PrincipalDep) -> Response:
    """Store one wire batch; a batch already stored is acknowledged with duplicate=true.

    The batch's run goes to the token's project; a batch naming another project, or a
    run of another project, is refused with 403 and nothing stored.
    """
    encoding = request.headers.get("content-encoding", "")
    call = ingest_worker.Call(principal, await request.body(), encoding)
    outcome = await request.app.state.ingest_pool.submit(call)
    if isinstance(outcome, ingest_worker.Refused):
        raise HTTPException(outcome.status, outcome.detail, outcome.headers)
    if isinstance(outcome, ingest_worker.Failed):
        return JSONResponse({"detail": "the batch could not be stored; retry"}, status_code=500)
    request.app.state.ingest_counters.record_batch(
        steps=outcome.steps, layer_values=outcome.layer_values, duplicate=outcome.duplicate
    )
    return Response(outcome.ack, media_type="application/json")
