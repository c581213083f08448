"""Conditional reads: the run answers the dashboard polls carry an ETag, and a caller that
sends it back (`If-None-Match`) while nothing changed gets a 304 with no body.

A run's answers (`deps.RunReadDep`: the run, its steps, layers, events, checkpoints) are
tagged with the run's change counter (`ampwatch.server.run_version`), read by the
existence check every run route makes already (`deps.existing_run_id`): an unchanged poll
costs no query of its own. The tag also names the run's creation time (SQLite may reuse
a deleted run's id) and `answer_tag`: the package version, the schema and the alerts
file, which shape the answers without bumping any run. Routes whose answers change
without a bump (the advisor, which reads the clock) are not tagged.

The alert lists are tagged with alerts counters instead, which only a write of an alert
moves: a run's alerts page with the run's (`Run.alerts_version`, read with the run:
`deps.RunAlertsReadDep`), the alerts across runs with their projects' (`alerts_tag`: one
project's, or every project's for the admin token), a tag that names the projects it
covers, since one URL answers each tenant its own.

The tagged answers are also kept, per process (`TaggedAnswers`, by URL and tag): a
thousand viewers of one run, each without the tag, cost one query per change of the run.

The runs list answers from many runs, so its tag is a digest of the answer (`digest_tag`):
it still runs its (small) query, and saves the bytes and the caller's decoding.
Answers say `Cache-Control: no-cache`: a browser keeps them, and asks again each time.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from datetime import datetime
from importlib import metadata

from fastapi import Request, Response

#: Where `deps.existing_run_id` leaves the run's (created_at, version, alerts_version), and
#: where `check_tag` leaves the answer's tag for `deps.SessionRoute`
#: to send.
RUN_VERSION_KEY = "ampwatch.run_version"
ETAG_KEY = "ampwatch.etag"
CACHE_CONTROL = "no-cache"


#: Bytes of tagged answers a collector process keeps; one answer at most an eighth of it.
KEPT_ANSWER_BYTES = 64 * 1024 * 1024


class TaggedAnswers:
    """Tagged answers by (URL, tag), least recently used out first, at most `max_bytes`.

    A tag names the run's version, so an entry is never stale: a write bumps the version
    and later requests look for another tag. Used on the event loop only (no lock)."""

    def __init__(self, max_bytes: int = KEPT_ANSWER_BYTES) -> None:
        self._max_bytes = max_bytes
        self._bytes = 0
        self._entries: OrderedDict[tuple[str, str], tuple[bytes, str]] = OrderedDict()

    def get(self, url: str, tag: str) -> tuple[bytes, str] | None:
        entry = self._entries.get((url, tag))
        if entry is not None:
            self._entries.move_to_end((url, tag))
        return entry

    def put(self, url: str, tag: str, body: bytes, media_type: str) -> None:
        if len(body) > self._max_bytes // 8:
            return
        old = self._entries.pop((url, tag), None)
        self._bytes += len(body) - (len(old[0]) if old else 0)
        self._entries[(url, tag)] = (body, media_type)
        while self._bytes > self._max_bytes:
            _, (evicted, _) = self._entries.popitem(last=False)
            self._bytes -= len(evicted)


class Kept(Exception):
    """The answer of this URL at this tag is kept: `deps.SessionRoute` sends it (raised by
    a dependency or an endpoint)."""

    def __init__(self, tag: str, body: bytes, media_type: str) -> None:
        super().__init__(tag)
        self.tag, self.body, self.media_type = tag, body, media_type


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


def check_run(request: Request, run_id: int, *, alerts: bool = False) -> None:
    """Raise `NotModified` when the caller holds the tag of run `run_id`'s answer (its
    counter as `deps.existing_run_id` read it; `alerts`: its alerts counter, for its
    alerts page), else leave the tag for the answer (`deps.RunReadDep`)."""
    created, version, alerts_version = request.scope[RUN_VERSION_KEY]
    assert isinstance(created, datetime)
    stamp = int(created.timestamp() * 1e6)
    counter = f"a{alerts_version}" if alerts else version
    check_tag(request, f'"r{run_id}.{stamp}.{counter}.{request.app.state.answer_tag}"')


def check_tag(request: Request, tag: str) -> None:
    """Raise `NotModified` when the caller holds `tag`, `Kept` when this URL's answer at
    `tag` is kept; else leave `tag` for the answer (`tag_response`). The tag must name
    everything the answer depends on besides the URL: who may see it included."""
    if held(request, tag):
        raise NotModified(tag)
    kept = request.app.state.tagged_answers.get(_url(request), tag)
    if kept is not None:
        raise Kept(tag, *kept)
    request.scope[ETAG_KEY] = tag


def alerts_tag(request: Request, project_id: int | str, version: int) -> str:
    """The tag of an alert list across runs: the projects it covers (one project's id, or
    `*` for every project) at their alerts counter (`Project.alerts_version`)."""
    return f'"a{project_id}.{version}.{request.app.state.answer_tag}"'


def _url(request: Request) -> str:
    return f"{request.url.path}?{request.url.query}"


def kept_response(kept: Kept) -> Response:
    return Response(
        kept.body,
        media_type=kept.media_type,
        headers={"ETag": kept.tag, "Cache-Control": CACHE_CONTROL},
    )


def tag_response(request: Request, response: Response) -> Response:
    """`response` with the tag `check_run` left, when it is a 200; its body is kept."""
    tag = request.scope.get(ETAG_KEY)
    if tag is not None and response.status_code == 200:
        response.headers["ETag"] = tag
        response.headers["Cache-Control"] = CACHE_CONTROL
        body = getattr(response, "body", None)  # a streamed answer has none: not kept
        if isinstance(body, bytes):
            media_type = response.media_type or "application/json"
            request.app.state.tagged_answers.put(_url(request), tag, body, media_type)
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
