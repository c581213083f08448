"""`ampwatch upload`: send an offline file, or a spool a finished process left behind.

Standard library only, so a training image can replay without the collector's extras.
Every batch carries its (run, stream, seq): the collector acknowledges one it already stored as a
duplicate, so uploading a file twice, or a spool that was partly delivered, stores nothing
twice. Batches are sent in file order; a collector that stays unreachable stops the upload
(run it again later: what was delivered is acknowledged as duplicates). From a spool
directory, each segment whose batches were all acknowledged is deleted (unless a live
process still writes it); an offline file is the user's and stays.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ampwatch.agent import wire
from ampwatch.agent.http_transport import post, request_headers
from ampwatch.agent.retry import retry_delay
from ampwatch.agent.spool import (
    LOCK_SUFFIX,
    SEGMENT_SUFFIX,
    frame_files,
    hold_lock,
    read_frames,
    segment_owner,
)


@dataclass
class UploadReport:
    """What an upload did, batch by batch."""

    stored: int = 0  # new to the collector
    duplicates: int = 0  # already stored: a re-upload, or delivered before the spool kept it
    rejected: int = 0  # 4xx: will never be stored (the message was printed)
    corrupt: int = 0  # lines that are not a whole batch (a torn last write)
    unsent: int = 0  # left when the collector stayed unreachable
    removed: int = 0  # spool segments deleted, every batch in them acknowledged

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
    files = frame_files(Path(path))
    spool = Path(path).is_dir()
    index = -1
    for number, file in enumerate(files):
        acknowledged = True
        frames = read_frames(file)
        for body in frames:
            index += 1
            if body is None:
                report.corrupt += 1  # a torn line: nothing to deliver, nothing to keep
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
                    acknowledged = False
                    detail = reply[:300].decode(errors="replace")
                    log(f"batch {index}: rejected (HTTP {status}): {detail}")
                    break
                if attempt < attempts:
                    sleep(delay)
            else:
                later = (b for rest in files[number + 1 :] for b in read_frames(rest))
                report.unsent = (
                    1 + sum(b is not None for b in frames) + sum(b is not None for b in later)
                )
                log(f"the collector at {url} is unreachable "
                    f"({reply[:200].decode(errors='replace')})")  # fmt: skip
                return report
        if spool and acknowledged and _remove_delivered(file):
            report.removed += 1
    return report


def _remove_delivered(segment: Path) -> bool:
    """Delete a delivered spool segment, unless the process that writes it is alive."""
    owner = segment_owner(segment)
    if segment.suffix != SEGMENT_SUFFIX or owner is None:
        return False
    lock_path = segment.with_name(f"{owner}{LOCK_SUFFIX}")
    lock = hold_lock(lock_path)
    if lock is None and lock_path.exists():
        return False  # alive (or locks unavailable): its own sender deletes it
    segment.unlink(missing_ok=True)
    if lock is not None:
        if not any(segment_owner(p) == owner for p in segment.parent.glob(f"*{SEGMENT_SUFFIX}")):
            lock_path.unlink(missing_ok=True)
        os.close(lock)
    return True
