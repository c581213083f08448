"""One ingest batch, handled in the ingest process (`ingest_pool`): the body decoded within
its bounds, parsed, validated, stored (`ingest.ingest_batch`) and answered as an `Outcome`,
which the collector's process turns into the HTTP answer (`api/ingest.py`).

Everything a batch costs is spent here, not in the process that serves reads: the
gzip, the JSON, the validation and the store. The caller was resolved before the body was
read (`api.deps.SessionRoute`), so a caller without a token costs this process nothing.

The same refusals as in one process: 400 bad gzip, 413 too large (decompressed; the body as
sent is bounded by `body_limit.BodyLimit`), 415 unknown encoding, 422 invalid batch,
403 another project, 503 with Retry-After for a busy database. An unexpected error is
logged here and answered 500; its transaction is rolled back. Log records of WARNING and
above travel back with the answer and are emitted in the collector's process, under their
own loggers (`Answer.logs`).

>>> outcome = handle(Call(Principal(project=None), body, "gzip"), sessions, 1 << 25)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import threading
import zlib
from dataclasses import dataclass
from multiprocessing.util import Finalize
from typing import Any

import orjson
from fastapi import HTTPException
from pydantic import ValidationError
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker

from ampwatch.server.alerts.config import with_file_rules
from ampwatch.server.auth import AuthError, Principal, project_for_new_data
from ampwatch.server.db import make_engine, make_sessionmaker
from ampwatch.server.errors import DATABASE_BUSY, RETRY_AFTER, validation_detail
from ampwatch.server.ingest import ingest_batch
from ampwatch.server.outbox import QUEUED_KEY
from ampwatch.server.schemas.wire import BatchIn
from ampwatch.server.settings import Settings
from ampwatch.server.webhook_delivery import DeliveryWorker

logger = logging.getLogger(__name__)

#: What a 422 for a bare NaN/Infinity literal says: the wire's own spelling (`wire.dumps`).
NON_FINITE_HINT = 'strict JSON: a non-finite float is written as "NaN", "Infinity", "-Infinity"'


@dataclass(frozen=True, slots=True)
class Call:
    """A batch as the collector's process received it: who sent it, its body as sent, and
    its `Content-Encoding` header ("" when none)."""

    principal: Principal
    body: bytes
    encoding: str


@dataclass(frozen=True, slots=True)
class Stored:
    """The batch is stored (or was already: `duplicate`): `ack` is the `IngestAck` as JSON;
    `steps` and `layer_values` are what it held, for the ingest counters; `queued`: a
    notification was queued, so the delivery worker should wake."""

    ack: bytes
    duplicate: bool
    steps: int
    layer_values: int
    queued: bool


@dataclass(frozen=True, slots=True)
class Refused:
    """A 4xx (or the 503 of a busy database): nothing was stored."""

    status: int
    detail: str | list[dict[str, Any]]
    headers: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class Failed:
    """An unexpected error, logged with its traceback: the batch was not stored."""

    error: str


Outcome = Stored | Refused | Failed


@dataclass(frozen=True, slots=True)
class Answer:
    """What the ingest process sends back for one call."""

    outcome: Outcome
    logs: tuple[logging.LogRecord, ...] = ()


def decoded_body(body: bytes, encoding: str, limit: int) -> bytes:
    """The body decompressed, at most `limit` bytes (raises HTTPException 400/413/415)."""
    encoding = encoding.strip().lower()
    if encoding in ("identity", ""):
        return body
    if encoding != "gzip":
        raise HTTPException(
            status_code=415, detail=f"Content-Encoding {encoding!r} unsupported; use gzip"
        )
    decompressor = zlib.decompressobj(wbits=zlib.MAX_WBITS | 16)  # gzip framing
    try:
        data = decompressor.decompress(body, limit + 1)
    except zlib.error as error:
        raise HTTPException(
            status_code=400, detail=f"Content-Encoding is gzip but the body is not: {error}"
        ) from None
    if len(data) > limit:
        raise HTTPException(
            status_code=413, detail=f"batch larger than {limit} bytes; send smaller batches"
        )
    if not decompressor.eof:
        raise HTTPException(status_code=400, detail="gzip body is truncated")
    return data


def parse_batch(body: bytes) -> BatchIn:
    """The body as a wire batch (raises HTTPException 422).

    Parsed as strict JSON by orjson: a bare NaN, Infinity or 1e999 (a number past a double)
    is a 422, as on every other route, because the wire has its own spelling of the
    non-finite floats (`wire.NON_FINITE`), which the agent always writes; a batch with a
    bare literal is no agent's, and storing 1e999 as +Inf would answer a typo with a
    measurement. Nesting deeper than orjson's 1,024 is a 422 too. Integers beyond 64 bits
    (only possible in an event's free-form `data`) are read as floats, as the dashboard's
    JavaScript reads them.
    """
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as error:  # its message names a position, never the text
        raise HTTPException(
            status_code=422, detail=f"Invalid JSON: {error} ({NON_FINITE_HINT})"
        ) from None
    if not isinstance(parsed, dict):
        raise HTTPException(status_code=422, detail="Input should be an object (a wire batch)")
    try:
        return BatchIn.model_validate(parsed)
    except ValidationError as error:
        raise HTTPException(status_code=422, detail=validation_detail(error.errors())) from None


def handle(call: Call, sessions: sessionmaker[Session], limit: int) -> Outcome:
    """Decode, validate and store one batch in a session of `sessions`; never raises."""
    try:
        batch = parse_batch(decoded_body(call.body, call.encoding, limit))
        named = batch.run.project if "project" in batch.run.model_fields_set else None
        batch.run.project = project_for_new_data(call.principal, named)
        with sessions() as session:
            ack = ingest_batch(session, batch)
            queued = bool(session.info.pop(QUEUED_KEY, False))
    except HTTPException as error:
        return Refused(error.status_code, error.detail, dict(error.headers or {}) or None)
    except AuthError as error:
        return Refused(error.status, error.message)
    except (OperationalError, PoolTimeout):
        return Refused(503, DATABASE_BUSY, RETRY_AFTER)
    except Exception as error:  # answered 500, never the end of the process
        logger.exception("storing an ingest batch failed; it was rolled back")
        return Failed(type(error).__name__)
    values = sum(len(record.names) * len(record.stats) for record in batch.layer_stats)
    return Stored(ack.model_dump_json().encode(), ack.duplicate, len(batch.steps), values, queued)


class Kept(logging.Handler):
    """Keeps the log records of the calls (this process's main thread runs them), made
    picklable, to send back with the answer; the notification worker's go to stderr, as
    they would without a handler."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self._elsewhere = logging.StreamHandler()

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread != threading.main_thread().ident:
            self._elsewhere.handle(record)
            return
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        record.msg, record.args, record.exc_info = record.getMessage(), None, None
        self.records.append(record)


def replay(records: tuple[logging.LogRecord, ...]) -> None:
    """Emit records `Kept` in the ingest process here, each by its own logger, so that
    this process's logging configuration applies to them."""
    for record in records:
        logging.getLogger(record.name).handle(record)


@dataclass(slots=True)
class _Process:
    """What the ingest process holds between calls."""

    sessions: sessionmaker[Session]
    limit: int
    delivery: DeliveryWorker


_process: _Process | None = None
_kept = Kept()


def start(settings: Settings) -> None:
    """The ingest process's initializer: its own engine and sessions on the collector's
    database (with the collector's alerts file), its log records kept for the answers, and
    the notification worker (`webhook_delivery`), woken by the batches that queue a
    notification: its writes take turns with the batches' in this process (`db`), and an
    alert leaves as soon as its batch committed. Stopped when the process ends."""
    global _process
    logging.getLogger().addHandler(_kept)
    engine = make_engine(settings.database_url)
    sessions = with_file_rules(make_sessionmaker(engine), settings.alerts_file)
    delivery = DeliveryWorker(sessions, settings).start()
    Finalize(delivery, delivery.stop, exitpriority=10)  # run as the process exits
    _process = _Process(sessions, settings.max_body_bytes, delivery)


def run(call: Call) -> Answer:
    """One call in the ingest process (after `start`)."""
    assert _process is not None, "ingest_worker.start runs first"
    try:
        outcome = handle(call, _process.sessions, _process.limit)
        if isinstance(outcome, Stored) and outcome.queued:
            _process.delivery.wake()  # the alert leaves now, not at the worker's next round
        return Answer(outcome, tuple(_kept.records))
    finally:
        _kept.records.clear()


def ready() -> int:
    """The ingest process's nice value: the collector waits for this call at startup, so
    the process is running (and its initializer passed) before the first batch, and runs
    its reads below it (`ingest_pool.yield_cpu_to_ingest`)."""
    getpriority = getattr(os, "getpriority", None)  # not on Windows
    return 0 if getpriority is None else getpriority(os.PRIO_PROCESS, 0)
