"""The collector's start-up heap is kept out of the garbage collector's full passes.

Why: a full (generation 2) collection walks every tracked object while holding the GIL,
and the collector's ~140,000 start-up objects (modules, routes, schemas, SQLAlchemy
mappers) live for ever. Under `bench/load.py` full collections ran 11-13 times a run and
stopped the event loop for 150-630 ms each, the worst `/healthz` answers of the bench.
Frozen (`gc.freeze`) after start-up, a full pass walks only what the requests created:
the longest fell to 190-255 ms on a loaded machine, most to 30-80 ms.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """Collect once, freeze what survives while serving, unfreeze on exit (a test process
    that ran a collector gets its collector back)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
