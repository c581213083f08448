"""A keep-alive HTTP/1.1 client on asyncio streams, for load generators that must cost the
machine less than the server they measure.

Why not httpx: `bench/load.py`'s 1,000 readers (an AsyncClient each) spent ~3.5 ms of CPU a
request on 2 cores, as much as the collector spent answering it, so the readers' figure was
bounded by their own client. This one sends a request and reads the status, the headers and a
`Content-Length` or chunked body: ~0.2 ms a request.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit


class ReadError(Exception):
    """The connection broke, timed out, or answered something this client does not read."""


class Connection:
    """One connection to `url`'s host, reopened after an error; requests one at a time."""

    def __init__(self, url: str, headers: dict[str, str], timeout: float) -> None:
        parts = urlsplit(url)
        self._host, self._port = parts.hostname or "127.0.0.1", parts.port or 80
        fixed = {"Host": f"{self._host}:{self._port}", **headers}
        self._fixed = "".join(f"{name}: {value}\r\n" for name, value in fixed.items())
        self._timeout = timeout
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def request(
        self, method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b""
    ) -> tuple[int, dict[str, str], bytes]:
        """(status, lower-cased headers, body) of a request; raises ReadError."""
        headers = {**(headers or {}), **({"Content-Length": str(len(body))} if body else {})}
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        request = f"{method} {path} HTTP/1.1\r\n{self._fixed}{extra}\r\n".encode() + body
        try:
            return await asyncio.wait_for(self._exchange(request), self._timeout)
        except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                asyncio.TimeoutError, ValueError) as error:  # fmt: skip
            await self.close()
            raise ReadError(type(error).__name__) from None

    async def _exchange(self, request: bytes) -> tuple[int, dict[str, str], bytes]:
        if self._streams is None:
            self._streams = await asyncio.open_connection(self._host, self._port, limit=1 << 20)
        reader, writer = self._streams
        writer.write(request)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split(" ", 2)[1])
        fields = dict(line.split(":", 1) for line in head[1:] if line)
        answer = {name.strip().lower(): value.strip() for name, value in fields.items()}
        if answer.get("transfer-encoding", "").lower() == "chunked":
            body = bytearray()
            while size := int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16):
                body += (await reader.readexactly(size + 2))[:-2]
            await reader.readuntil(b"\r\n")
        else:
            body = bytearray(await reader.readexactly(int(answer.get("content-length", "0"))))
        if answer.get("connection", "").lower() == "close":
            await self.close()
        return status, answer, bytes(body)

    async def close(self) -> None:
        if self._streams is not None:
            writer = self._streams[1]
            self._streams = None
            writer.close()
