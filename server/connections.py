"""Idle connections are closed: a connection must send a complete request head within
`Settings.request_head_timeout` seconds of opening, or of its previous response.

uvicorn closes a keep-alive connection that stays silent after a response, but arms that
timer only after a first response and restarts it on every byte received: a client that
connects and says nothing, or trickles its headers a byte at a time (slowloris), held a
connection and its buffers for ever. `serving` runs uvicorn with this protocol.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeadDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline for each request head: the config's
    `timeout_keep_alive` (`serving` sets it from `Settings.request_head_timeout`).
    Module level, so that uvicorn's worker processes can unpickle their config."""

    _head_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.timeout_keep_alive, self._expire)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _expire(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
