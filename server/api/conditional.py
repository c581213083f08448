"""Conditional reads: the run answers the dashboard polls carry an ETag, and a caller that
sends it back (`If-None-Match`) while nothing changed gets a 304 with no body.

A run's answers (`deps.RunReadDep`: the run, its steps, layers, events, checkpoints) are tagged
with the run's change counter (`ampwatch.server.run_version`), read by the existence check
every run route makes already (`deps.existing_run_id`): an unchanged poll costs no query
of its own. The tag also names the run's creation time (SQLite may reuse a deleted run's
id) and `answer_tag`: the package version, the schema and the alerts file, which shape the
answers without bumping any run. Routes whose answers change without a bump (alerts, which
an ack or the sweep moves; the advisor) are not tagged.

The runs list answers from many runs, so its tag is a digest of the answer (`digest_tag`):
it still runs its (small) query, and saves the bytes and the caller's decoding.
Answers say `Cache-Control: no-cache`: a browser keeps them, and asks again each time.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from importlib import metadata

from fastapi import Request, Response

#: Where `deps.existing_run_id` leaves the run's (created_at, version), and where
#: `unchanged_run` leaves the answer's tag for `deps.SessionRoute` to send.
RUN_VERSION_KEY = "ampwatch.run_version"
ETAG_KEY = "ampwatch.etag"
CACHE_CONTROL = "no-cache"


class NotModified(Exception):
    """The caller holds the current answer: `deps.SessionRoute` answers 304."""

    def __init__(self, tag: str) -> None:
        super().__init__(tag)
        self.tag = tag


def answer_tag(migration_head: str, alerts_file: object) -> str:
    """What shapes every answer besides the data: the package, schema and alerts file.

    >>> answer_tag("0016", {}) == answer_tag("0016", {})
    True
    """
    try:
        package = metadata.version("ampwatch")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        package = "source"
    text = f"{package}|{migration_head}|{alerts_file!r}"
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def held(request: Request, tag: str) -> bool:
    """Whether the request's `If-None-Match` names `tag` (or is `*`)."""
    header = request.headers.get("if-none-match")
    if header is None:
        return False
    return any(part.strip() in (tag, "*", f"W/{tag}") for part in header.split(","))


def check_run(request: Request, run_id: int) -> None:
    """Raise `NotModified` when the caller holds the tag of run `run_id`'s answer (its
    counter as `deps.existing_run_id` read it), else leave the tag for the answer
    (`deps.RunReadDep`)."""
    created, version = request.scope[RUN_VERSION_KEY]
    assert isinstance(created, datetime)
    stamp = int(created.timestamp() * 1e6)
    tag = f'"r{run_id}.{stamp}.{version}.{request.app.state.answer_tag}"'
    if held(request, tag):
        raise NotModified(tag)
    request.scope[ETAG_KEY] = tag


def tag_response(request: Request, response: Response) -> Response:
    """`response` with the tag `check_run` left, when it is a 200."""
    tag = request.scope.get(ETAG_KEY)
    if tag is not None and response.status_code == 200:
        response.headers["ETag"] = tag
        response.headers["Cache-Control"] = CACHE_CONTROL
    return response


def not_modified(error: NotModified) -> Response:
    return Response(status_code=304, headers={"ETag": error.tag, "Cache-Control": CACHE_CONTROL})


def digest_tag(request: Request, body: bytes, media_type: str = "application/json") -> Response:
    """`body` tagged with its digest, or a 304 when the caller holds it already."""
    tag = f'"d{hashlib.blake2b(body, digest_size=12).hexdigest()}"'
    if held(request, tag):
        return not_modified(NotModified(tag))
    headers = {"ETag": tag, "Cache-Control": CACHE_CONTROL}
    return Response(body, media_type=media_type, headers=headers)
