"""`POST /api/v1/ingest`: the agent's only write path.

The body is read by hand rather than declared as a pydantic parameter, because agents
send it gzip-compressed (`Content-Encoding: gzip`) and its size must be bounded both
before and after decompression. Every problem with the body is a 4xx that says what is
wrong: 400 bad gzip, 413 too large, 415 unknown encoding, 422 invalid batch.
"""

from __future__ import annotations

import zlib
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, ValidationError

from ampwatch.agent.wire import API_PREFIX, INGEST_PATH
from ampwatch.server.api.deps import NOT_YOURS, PrincipalDep, SessionDep, SessionRoute, SettingsDep
from ampwatch.server.auth import project_for_new_data
from ampwatch.server.errors import validation_detail
from ampwatch.server.ingest import ingest_batch
from ampwatch.server.outbox import QUEUED_KEY
from ampwatch.server.schemas.errors import ErrorPublic
from ampwatch.server.schemas.runs import IngestAck
from ampwatch.server.schemas.wire import BatchIn

router = APIRouter(route_class=SessionRoute, tags=["ingest"])


async def read_body(request: Request, settings: SettingsDep) -> bytes:
    """The request body, decompressed, at most `settings.max_body_bytes` either way (as
    sent: `body_limit.BodyLimit`, for every route)."""
    limit = settings.max_body_bytes
    too_large = HTTPException(
        status_code=413, detail=f"batch larger than {limit} bytes; send smaller batches"
    )
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("identity", ""):
        return bytes(body)
    if encoding != "gzip":
        raise HTTPException(
            status_code=415, detail=f"Content-Encoding {encoding!r} unsupported; use gzip"
        )
    decompressor = zlib.decompressobj(wbits=zlib.MAX_WBITS | 16)  # gzip framing
    try:
        data = decompressor.decompress(bytes(body), limit + 1)
    except zlib.error as error:
        raise HTTPException(
            status_code=400, detail=f"Content-Encoding is gzip but the body is not: {error}"
        ) from None
    if len(data) > limit:
        raise too_large
    if not decompressor.eof:
        raise HTTPException(status_code=400, detail="gzip body is truncated")
    return data


BodyDep = Annotated[bytes, Depends(read_body)]


def parse_json(body: bytes) -> Any:
    """The body as Python objects, parsed as strict JSON by orjson: a bare NaN, Infinity
    or 1e999 (a number past a double) is a 422, as on every other route, because the wire
    has its own spelling of the non-finite floats (`wire.NON_FINITE`), which the agent
    always writes; a batch with a bare literal is no agent's, and storing 1e999 as +Inf
    would answer a typo with a measurement. Nesting deeper than orjson's 1,024 is a 422 too.
    Integers beyond 64 bits (only possible in an event's free-form `data`) are read as
    floats, as the dashboard's JavaScript reads them.
    """
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as error:  # its message names a position, never the text
        raise HTTPException(
            status_code=422,
            detail=f"Invalid JSON: {error} ({NON_FINITE_HINT})",
        ) from None


#: What a 422 for a bare NaN/Infinity literal says: the wire's own spelling (`wire.dumps`).
NON_FINITE_HINT = 'strict JSON: a non-finite float is written as "NaN", "Infinity", "-Infinity"'


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
def ingest(
    body: BodyDep, session: SessionDep, principal: PrincipalDep, request: Request
) -> IngestAck:
    """Store one wire batch; a batch already stored is acknowledged with duplicate=true.

    The batch's run goes to the token's project; a batch naming another project, or a
    run of another project, is refused with 403 and nothing stored.
    """
    parsed = parse_json(body)
    if not isinstance(parsed, dict):
        raise HTTPException(status_code=422, detail="Input should be an object (a wire batch)")
    try:
        batch = BatchIn.model_validate(parsed)
    except ValidationError as error:
        raise HTTPException(status_code=422, detail=validation_detail(error.errors())) from None
    named = batch.run.project if "project" in batch.run.model_fields_set else None
    batch.run.project = project_for_new_data(principal, named)
    ack = ingest_batch(session, batch)
    request.app.state.ingest_counters.record_batch(batch, duplicate=ack.duplicate)
    delivery = getattr(request.app.state, "delivery", None)  # None: no lifespan (tests)
    if session.info.pop(QUEUED_KEY, False) and delivery is not None:
        delivery.wake()  # the alert leaves now, not at the worker's next round
    return ack
