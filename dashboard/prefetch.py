"""Reads a page's data while the browser is still loading the dashboard's scripts.

Why: a visit to `/run/<id>` by its URL (a bookmark, an alert's link) first downloads and
runs Dash's scripts, then asks for the app's layout (which holds the page), and only then
would the server start the page's seven API reads. Started when the HTML is served, the
reads overlap the script loading, and the page's layout takes their result. A
visit by an in-app link (scripts already running) never prefetches: it has nothing to
overlap.

    >>> p = Prefetcher(lambda key: key * 2)
    >>> p.start(21)
    >>> p.take(21), p.take(21)
    (42, None)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: A result older than this is read again: the page must not open on stale data.
FRESH_SECONDS = 10.0
#: At most this many pending results; a burst of page loads drops the oldest.
MOST = 8


class Prefetcher(Generic[K, V]):
    """`start(key)` runs `read(key)` in the background; `take(key)` hands its result to the
    first caller that asks for it within `FRESH_SECONDS`, else None (read it yourself)."""

    def __init__(
        self,
        read: Callable[[K], V],
        *,
        fresh_seconds: float = FRESH_SECONDS,
        most: int = MOST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._clock = clock
        self._fresh = fresh_seconds
        self._most = most
        self._pending: dict[K, tuple[float, Future[V]]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ampwatch-prefetch")

    def start(self, key: K) -> None:
        with self._lock:
            if key in self._pending:
                return
            while len(self._pending) >= self._most:
                del self._pending[next(iter(self._pending))]
            self._pending[key] = (self._clock(), self._pool.submit(self._read, key))

    def take(self, key: K) -> V | None:
        with self._lock:
            started, future = self._pending.pop(key, (0.0, None))
        if future is None or self._clock() - started > self._fresh:
            return None
        try:
            return future.result()
        except Exception:  # noqa: BLE001 - the caller reads again and reports its own error
            return None
