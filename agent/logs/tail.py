"""Reading a log that is still being written, as `tail -F` does.

- A last line without its newline yet is held until it is complete (a tqdm bar's ``\\r``
  redraws count as complete pieces: a bar may not end its line for a whole epoch).
- Rotation (the path now names another file: logrotate's rename, a new job's log): the
  old file is read to its end, its unterminated last line taken as complete, then the new
  file is read from its start.
- Truncation (the file got shorter: `copytruncate`, a job rewriting its log with `>`):
  read again from the start.
- A process restarting and appending (`>>`): just more lines; the parser sees the restart.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, final

#: Bytes read per `poll()` at most, so a huge backlog is taken in bounded bites.
READ_BYTES = 4 * 1024 * 1024


@final
class LogTail:
    """`poll()` returns the complete lines (decoded, no newline) written since the last
    call; it never blocks. `from_end=True` skips what the file already holds."""

    def __init__(self, path: str | os.PathLike[str], *, from_end: bool = False) -> None:
        self.path = Path(path)
        self._file: BinaryIO | None = None
        self._inode: int | None = None
        self._partial = b""
        self._from_end = from_end
        self.rotations = 0
        self.truncations = 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> LogTail:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> bool:
        try:
            handle = self.path.open("rb")
        except FileNotFoundError:
            return False
        self._file = handle
        self._inode = os.fstat(handle.fileno()).st_ino
        if self._from_end:
            handle.seek(0, os.SEEK_END)
            self._from_end = False
        return True

    def poll(self) -> list[str]:
        if self._file is None and not self._open():
            return []
        assert self._file is not None
        chunk = self._file.read(READ_BYTES)
        if chunk:
            return self._split(chunk, final=False)
        try:
            status = os.stat(self.path)
        except FileNotFoundError:
            return []  # rotated away, the new file not created yet: wait for it
        if status.st_ino != self._inode:
            rest = self._split(b"", final=True)  # the old file's unterminated last line
            self.close()
            self.rotations += 1
            return rest + (self.poll() if self._open() else [])
        if status.st_size < self._file.tell():
            self._file.seek(0)
            self._partial = b""
            self.truncations += 1
            return self.poll()
        return []

    def _split(self, chunk: bytes, *, final: bool) -> list[str]:
        data = self._partial + chunk
        complete, _, self._partial = data.rpartition(b"\n")
        lines = complete.split(b"\n") if complete or data.startswith(b"\n") else []
        if self._partial and b"\r" in self._partial and not final:
            done, _, self._partial = self._partial.rpartition(b"\r")
            lines.append(done + b"\r")
        if final and self._partial:
            lines.append(self._partial)
            self._partial = b""
        # "\r\n" endings lose their "\r"; a bar's redraws inside a line stay for its parser.
        return [line.decode("utf-8", errors="replace").removesuffix("\r") for line in lines]
