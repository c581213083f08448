"""Sealed batches on disk: the spool the sender fills while the collector is unreachable,
and the file format it shares with offline mode and `ampwatch upload`.

Format: one sealed batch per line, the gzip JSON body exactly as it is POSTed, in base64.
Lines make the file appendable by a crashing process and readable by the next one: a torn
last line fails its base64/gzip check and is skipped, never misread as another batch; base64
costs a third over the gzip body but keeps every frame self-delimiting without a length
prefix that a torn write could corrupt. Each body carries its own (run, stream, seq), so a file needs
no header, can hold several runs, and replaying it twice stores nothing twice.

The spool is a directory of such files ("segments", named by their first seq and the
writing process's nonce, appended to, deleted once every batch in them is acknowledged),
bounded by `max_bytes`: when full it
empties the oldest batches of their layer statistics first, then of their steps, and
writes what it removed into that batch's own "dropped" field (so the count arrives with the
seq; a batch the collector already stored is a duplicate, and nothing was lost). Segments
left with nothing but such counts are deleted first (their counts are reported again), and
older segments go whole before the newest one loses a step (`Spool._shrink`). Events (run
start and end, checkpoints: a few per run) are never emptied, and the newest segment is
never deleted, so the run's end always arrives.

A process that dies leaves its segments behind; the next `Spool` of the same directory
(the next `watch()` of the same run) adopts them and replays them first, unchanged, so
their (run, stream, seq) make the delivery exactly once. Each spool holds an advisory
lock (`<nonce>.lock`, `flock`) while it lives, so segments of a live process (another
rank of the same run on this host) are never adopted; without `fcntl` (Windows) nothing
is adopted and `ampwatch upload` replays what is left.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import hashlib
import json
import os
import re
import urllib.parse
import uuid
import zlib
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ampwatch.agent import wire
from ampwatch.agent.config import from_environment

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no adoption (module docstring)
    fcntl = None  # type: ignore[assignment]

SEGMENT_SUFFIX = ".spool"
LOCK_SUFFIX = ".lock"
_SEGMENT_NAME = re.compile(r"^\d{12}-(?P<nonce>[0-9a-f]{8})" + re.escape(SEGMENT_SUFFIX) + "$")
#: Longest folder name used as is; longer run ids are cut and suffixed with their hash.
_MAX_FOLDER_NAME = 200


def spool_folder_name(client_run_id: str) -> str:
    """`client_run_id` as one folder name that stays inside the spool root: a plain id is
    kept as is; `/`, `..` and other characters a path would read are %-quoted.

    >>> spool_folder_name("../../etc")
    '..%2F..%2Fetc'
    >>> spool_folder_name("..")
    '%2E%2E'
    """
    name = urllib.parse.quote(client_run_id, safe="")
    if name.strip(".") == "":  # "", ".", "..": not a folder of their own
        name = name.replace(".", "%2E") or "%00"
    if len(name) > _MAX_FOLDER_NAME:
        digest = hashlib.sha256(client_run_id.encode()).hexdigest()[:16]
        name = f"{name[: _MAX_FOLDER_NAME - 17]}-{digest}"
    return name


def default_spool_dir(client_run_id: str) -> Path:
    """`$AMPWATCH_SPOOL_DIR/<run>` or `~/.cache/ampwatch/spool/<run>` (XDG_CACHE_HOME),
    `<run>` made a safe folder name (`spool_folder_name`)."""
    root = from_environment("SPOOL_DIR")
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = str(Path(cache) / "ampwatch" / "spool")
    return Path(root) / spool_folder_name(client_run_id)


def hold_lock(path: Path) -> int | None:
    """An exclusive `flock` on `path` (created if missing) as an open descriptor, or None
    when another live process holds it (or locks are unavailable)."""
    if fcntl is None:
        return None
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(descriptor)
        return None
    return descriptor


def segment_owner(path: Path) -> str | None:
    """The nonce of the spool that wrote segment `path` (None: not a segment name)."""
    match = _SEGMENT_NAME.match(path.name)
    return match["nonce"] if match else None


def encode_frame(body: bytes) -> bytes:
    return base64.b64encode(body) + b"\n"


def _line_length(body: bytes) -> int:
    return 4 * ((len(body) + 2) // 3) + 1


def decode_frame(line: bytes) -> bytes | None:
    """The gzip body of one line, or None if the line is torn or not a frame."""
    try:
        body = base64.b64decode(line.strip(), validate=True)
        gzip.decompress(body)  # checks the CRC: a torn write never passes as a batch
    except (binascii.Error, OSError, EOFError, zlib.error):
        return None
    return body


def read_frames(path: Path) -> Iterator[bytes | None]:
    """Every frame of a spool segment or offline file, in order; None for a bad line."""
    with path.open("rb") as lines:
        for line in lines:
            if line.strip():
                yield decode_frame(line)


def frame_files(path: Path) -> list[Path]:
    """`path` itself, or every segment under a spool directory in seq order (by run)."""
    if path.is_dir():
        return sorted(path.rglob(f"*{SEGMENT_SUFFIX}"))
    return [path]


@dataclass
class Frame:
    """A sealed batch: its seq, gzip body and record counts (the body is the truth)."""

    seq: int
    body: bytes
    records: dict[str, int]
    drops: dict[str, int]

    def strip(self, kinds: tuple[str, ...]) -> dict[str, int]:
        """Remove every record of `kinds`, counting them in the batch's "dropped" field."""
        batch: dict[str, Any] = json.loads(gzip.decompress(self.body))
        removed = {kind: len(batch[kind]) for kind in kinds}
        for kind, n in removed.items():
            batch[kind] = []
            batch["dropped"][kind] = batch["dropped"].get(kind, 0) + n
            self.records[kind] = 0
            self.drops[kind] = self.drops.get(kind, 0) + n
        text = json.dumps(batch, allow_nan=False)
        self.body = gzip.compress(text.encode(), compresslevel=5)
        return removed


@dataclass
class _Entry:
    """A spooled frame's place in its segment; the body stays on disk."""

    seq: int
    offset: int
    length: int  # of the line, newline included
    records: dict[str, int]
    drops: dict[str, int]


@dataclass
class _Segment:
    path: Path
    entries: deque[_Entry] = field(default_factory=deque)
    end: int = 0  # file size
    #: Left by a dead process: replayed, never appended to (its last line may be torn).
    adopted: bool = False

    def intact(self) -> bool:
        """Still the file this process wrote (not deleted or changed by someone else)?"""
        try:
            return self.path.stat().st_size == self.end
        except OSError:
            return False

    def read(self, entry: _Entry) -> Frame:
        with self.path.open("rb") as segment:
            segment.seek(entry.offset)
            line = segment.read(entry.length)
        body = decode_frame(line) if len(line) == entry.length else None
        if body is None:
            raise ValueError(f"{self.path} is damaged at byte {entry.offset}")
        return Frame(entry.seq, body, dict(entry.records), dict(entry.drops))


def _scan(path: Path) -> _Segment | None:
    """A segment another process wrote, as entries (torn lines skipped); None if unreadable."""
    segment = _Segment(path, adopted=True)
    try:
        with path.open("rb") as lines:
            for line in lines:
                body = decode_frame(line) if line.strip() else None
                if body is not None:
                    batch = json.loads(gzip.decompress(body))
                    records = {kind: len(batch.get(kind) or []) for kind in wire.DROPPED_KINDS}
                    drops = {k: int(batch.get("dropped", {}).get(k, 0)) for k in wire.DROPPED_KINDS}
                    segment.entries.append(
                        _Entry(int(batch["seq"]), segment.end, len(line), records, drops)
                    )
                segment.end += len(line)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not segment.entries:  # nothing deliverable: only torn lines
        path.unlink(missing_ok=True)
        return None
    return segment


class Spool:
    """The on-disk queue of sealed batches of one sender, oldest first.

    Memory holds only each unacknowledged frame's offset and counts; the bodies are read
    back one at a time. Not thread-safe: only the sender thread uses it.
    """

    def __init__(
        self, directory: Path, *, max_bytes: int, segment_bytes: int | None = None
    ) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._segment_bytes = segment_bytes or max(4096, max_bytes // 8)
        self._segments: deque[_Segment] = deque()
        # In segment names: a resumed run (same run id, so same directory, seq from 0 again)
        # must never append to a segment its crashed predecessor left behind.
        self._nonce = uuid.uuid4().hex[:8]
        self._head: Frame | None = None
        self.nbytes = 0  # of the frames not yet acknowledged
        self._lock: int | None = None  # held from our first segment on
        self._adopted: dict[str, int] | None = None  # dead owners' nonce -> lock held

    def __len__(self) -> int:
        self._adopt()
        return sum(len(segment.entries) for segment in self._segments)

    def _adopt(self) -> None:
        """Once, before first use (on the sender thread): take over the segments that dead
        processes left in this directory, oldest first, ahead of anything of ours."""
        if self._adopted is not None:
            return
        self._adopted = {}
        if fcntl is None or not self.directory.is_dir():
            return
        by_owner: dict[str, list[Path]] = {}
        for path in sorted(self.directory.glob(f"*{SEGMENT_SUFFIX}")):
            owner = segment_owner(path)
            if owner is not None and owner != self._nonce:
                by_owner.setdefault(owner, []).append(path)
        adopted: list[_Segment] = []
        for owner, paths in by_owner.items():
            lock = hold_lock(self.directory / f"{owner}{LOCK_SUFFIX}")
            if lock is None:  # alive: another rank of this run, say
                continue
            self._adopted[owner] = lock
            adopted += [segment for path in paths if (segment := _scan(path)) is not None]
        adopted.sort(key=lambda segment: segment.path.name)
        for segment in reversed(adopted):
            self._segments.appendleft(segment)
            self.nbytes += sum(entry.length for entry in segment.entries)
        for owner in list(self._adopted):
            self._release_if_done(owner)

    def _release_if_done(self, owner: str | None) -> None:
        """Drop a dead owner's lock file once none of its segments is left."""
        if owner is None or not self._adopted or owner not in self._adopted:
            return
        if any(segment_owner(segment.path) == owner for segment in self._segments):
            return
        (self.directory / f"{owner}{LOCK_SUFFIX}").unlink(missing_ok=True)
        os.close(self._adopted.pop(owner))

    def _delete(self, segment: _Segment) -> None:
        segment.path.unlink(missing_ok=True)
        self._release_if_done(segment_owner(segment.path))
        if self._lock is not None and not any(not s.adopted for s in self._segments):
            # Nothing of ours on disk: no lock file left behind (a new segment takes one).
            (self.directory / f"{self._nonce}{LOCK_SUFFIX}").unlink(missing_ok=True)
            os.close(self._lock)
            self._lock = None

    def carried_drops(self) -> dict[str, int]:
        """The drop counts the spooled batches carry in their own "dropped" fields (counted
        by the sender when they happened): a deleted batch takes them along, and they must be
        reported again, but not counted as new drops."""
        self._adopt()
        total = dict.fromkeys(wire.DROPPED_KINDS, 0)
        for segment in self._segments:
            for entry in segment.entries:
                for kind in wire.DROPPED_KINDS:
                    total[kind] += entry.drops.get(kind, 0)
        return total

    def append(self, frame: Frame) -> tuple[dict[str, int], dict[str, int]]:
        """Write `frame`, then hold the bound. Returns (records emptied from spooled batches,
        already counted in their own "dropped"; records lost with deleted segments, whose
        counts the caller must report in a later batch). Raises OSError (disk full...)."""
        self._adopt()
        last = self._segments[-1] if self._segments else None
        if last is None or last.adopted or last.end >= self._segment_bytes or not last.intact():
            self.directory.mkdir(parents=True, exist_ok=True)
            if self._lock is None:  # before our first segment: never adopted while we live
                self._lock = hold_lock(self.directory / f"{self._nonce}{LOCK_SUFFIX}")
            last = _Segment(self.directory / f"{frame.seq:012d}-{self._nonce}{SEGMENT_SUFFIX}")
            self._segments.append(last)
        line = encode_frame(frame.body)
        with last.path.open("ab") as out:
            out.write(line)
        last.entries.append(
            _Entry(frame.seq, last.end, len(line), dict(frame.records), dict(frame.drops))
        )
        last.end += len(line)
        self.nbytes += len(line)
        if self.nbytes <= self.max_bytes:
            return {}, {}
        return self._shrink(target=self.max_bytes * 3 // 4)

    def peek(self) -> Frame | None:
        """The oldest unacknowledged frame, read back from disk (once). Raises OSError or
        ValueError if its segment was deleted or damaged under us; `pop()` skips it."""
        self._adopt()
        if self._head is None and self._segments:
            segment = self._segments[0]
            self._head = segment.read(segment.entries[0])
        return self._head

    def pop(self) -> dict[str, int]:
        """Forget the oldest frame (acknowledged, or unreadable); a segment with none left
        is deleted. Returns the records it held and reported dropped, for an unreadable one."""
        segment = self._segments[0]
        entry = segment.entries.popleft()
        self.nbytes -= entry.length
        self._head = None
        if not segment.entries:
            self._segments.popleft()
            self._delete(segment)
        return {kind: entry.records[kind] + entry.drops[kind] for kind in wire.DROPPED_KINDS}

    def _shrink(self, target: int) -> tuple[dict[str, int], dict[str, int]]:
        """Down to `target` (hysteresis, not just the bound: a full spool is rewritten once
        per several batches, not once per batch), losing the least first: batches left with
        only counts (reported again), the oldest layer statistics, the steps of all but the
        newest segment, older segments whole, and last the newest segment's steps."""
        self._head = None
        emptied: dict[str, int] = {}
        lost: dict[str, int] = {}
        self._delete_oldest(target, lost, only_empty=True)
        self._strip(self._segments, ("layer_stats",), target, emptied)
        self._delete_oldest(target, lost, only_empty=True)
        self._strip(list(self._segments)[:-1], ("steps",), target, emptied)
        self._delete_oldest(target, lost, only_empty=False)
        self._strip(self._segments, ("steps",), target, emptied)
        return emptied, lost

    def _strip(
        self,
        segments: Iterable[_Segment],
        kinds: tuple[str, ...],
        target: int,
        emptied: dict[str, int],
    ) -> None:
        for segment in segments:
            if self.nbytes <= target:
                return
            self._strip_segment(segment, kinds, target, emptied)

    def _delete_oldest(self, target: int, lost: dict[str, int], *, only_empty: bool) -> None:
        """Delete the oldest segments (never the newest) while over `target`, adding what
        they held and carried to `lost`; `only_empty`: stop at one that holds a record."""
        while self.nbytes > target and len(self._segments) > 1:
            segment = self._segments[0]
            if only_empty and any(any(entry.records.values()) for entry in segment.entries):
                return
            self._segments.popleft()
            for entry in segment.entries:
                for kind in wire.DROPPED_KINDS:
                    lost[kind] = lost.get(kind, 0) + entry.records[kind] + entry.drops[kind]
                self.nbytes -= entry.length
            self._delete(segment)

    def _strip_segment(
        self, segment: _Segment, kinds: tuple[str, ...], target: int, emptied: dict[str, int]
    ) -> None:
        """Empty the segment's oldest frames of `kinds` until the spool is under `target`;
        written aside, then renamed: a crash leaves the old segment or the new one."""
        if not any(entry.records[kind] for entry in segment.entries for kind in kinds):
            return
        frames = [segment.read(entry) for entry in segment.entries]
        size = sum(entry.length for entry in segment.entries)
        projected = self.nbytes
        for frame in frames:
            if projected <= target:
                break
            if any(frame.records[kind] for kind in kinds):
                before = _line_length(frame.body)
                for kind, n in frame.strip(kinds).items():
                    emptied[kind] = emptied.get(kind, 0) + n
                projected -= before - _line_length(frame.body)
        lines = [encode_frame(frame.body) for frame in frames]
        partial = segment.path.with_suffix(".tmp")
        partial.write_bytes(b"".join(lines))
        os.replace(partial, segment.path)
        segment.entries.clear()
        offset = 0
        for frame, line in zip(frames, lines):
            segment.entries.append(_Entry(frame.seq, offset, len(line), frame.records, frame.drops))
            offset += len(line)
        self.nbytes += offset - size
        segment.end = offset
