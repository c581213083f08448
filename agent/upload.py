"""`ampwatch upload`: send an offline file, or a spool a finished process left behind.

Standard library only, so a training image can replay without the collector's extras.
Every batch carries its (run, stream, seq): the collector acknowledges one it already stored as a
duplicate, so uploading a file twice, or a spool that was partly delivered, stores nothing
twice. Batches are sent in file order; a collector that stays unreachable stops the upload
(run it again later: what was delivered is acknowledged as duplicates).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ampwatch.agent import wire
from ampwatch.agent.spool import frame_files, read_frames
from ampwatch.agent.transport import post, request_headers, retry_delay


@dataclass
class UploadReport:
    """What an upload did, batch by batch."""

    stored: int = 0  # new to the collector
    duplicates: int = 0  # already stored: a re-upload, or delivered before the spool kept it
    rejected: int = 0  # 4xx: will never be stored (the message was printed)
    corrupt: int = 0  # lines that are not a whole batch (a torn last write)
    unsent: int = 0  # left when the collector stayed unreachable

    @property
    def complete(self) -> bool:
        return self.rejected == 0 and self.unsent == 0


def upload(
    path: str | Path,
    url: str,
    *,
    token: str | None = None,
    timeout: float = 30.0,
    attempts: int = 5,
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] = print,
) -> UploadReport:
    """Send every batch in `path` (an offline file, or a spool directory) to `url`.

    >>> upload("run.ampwatch", "http://127.0.0.1:8765").stored  # doctest: +SKIP
    12
    """
    endpoint = url.rstrip("/") + wire.INGEST_PATH
    headers = request_headers(token)
    report = UploadReport()
    frames = (body for file in frame_files(Path(path)) for body in read_frames(file))
    for index, body in enumerate(frames):
        if body is None:
            report.corrupt += 1
            continue
        status: int | None = None
        reply = b""
        for attempt in range(1, attempts + 1):
            try:
                status, reply = post(endpoint, body, headers, timeout=timeout)
            except OSError as exc:
                status, reply = None, str(exc).encode()
            if status is not None and 200 <= status < 300:
                duplicate = bool(json.loads(reply or b"{}").get("duplicate"))
                report.duplicates += duplicate
                report.stored += not duplicate
                break
            delay = retry_delay(attempt, status)
            if delay is None:
                report.rejected += 1
                detail = reply[:300].decode(errors="replace")
                log(f"batch {index}: rejected (HTTP {status}): {detail}")
                break
            if attempt < attempts:
                sleep(delay)
        else:
            report.unsent = 1 + sum(b is not None for b in frames)
            log(f"the collector at {url} is unreachable ({reply[:200].decode(errors='replace')})")
            return report
    return report
