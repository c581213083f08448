"""The ingest process: agents' batches are stored by a process of their own
(`ingest_worker`), so that a batch never shares a GIL with the reads this process serves.

Why: on 2 cores, under 1,000 closed-loop readers and 32 agents (`bench/load.py`), ingest
in the collector's process took about two thirds of its one GIL (a 50-step batch with 5
layer samples of 64 layers ~20 ms of CPU), so either batches waited behind reads (p50
24 s, every alert as late) or reads waited for the gaps between batches (~50 reads/s,
p99 25 s, with ingest p99 still ~1.9 s). Here the collector's process only receives a
body and relays it (`api/ingest.py`); decoding, validation, the store and the alert
engine run in the ingest process, on the other core.

How: a `concurrent.futures.ProcessPoolExecutor` of `settings.ingest_processes`
processes, started from a fork server that has imported `ingest_worker` once (a collector
start then costs a fork, not an interpreter and its imports; `spawn` where there is no
fork server), each with its own engine on the collector's database. More than one helps
only on PostgreSQL: SQLite has one writer at a time. A process that dies (killed, out of
memory) breaks the pool: the batches it held are answered 503 with Retry-After, which
agents retry (a batch it had committed is then acknowledged as a duplicate), and a new
pool takes the next batch.

>>> pool = IngestPool(settings)  # doctest: +SKIP
>>> outcome = await pool.submit(ingest_worker.Call(principal, body, "gzip"))  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.context import BaseContext

from ampwatch.server import ingest_worker
from ampwatch.server.errors import RETRY_AFTER
from ampwatch.server.settings import Settings

logger = logging.getLogger(__name__)

#: What a batch held by an ingest process that died is answered (503: agents retry).
PROCESS_DIED = "the collector's ingest process stopped while storing this batch; retry"
#: The lowest CPU priority a Unix thread can have (its highest nice value).
_LOWEST = 19


def _context() -> BaseContext:
    """A fork server's context, else `spawn`'s.

    The fork server imports `ingest_worker` before it forks, so an ingest process starts in
    ~0.1 s instead of the ~2 s its imports take (`__main__` stays in the list, the default,
    which Pythons whose fork server passes it the main module's path preload too). As with
    every start method but fork, each process imports the main module as `__mp_main__`
    (pytest's entry point: +0.15 s a start under the tests): a script that starts a
    collector needs the usual `if __name__ == "__main__":`, else its ingest process stops
    and the collector does not start (`IngestPool.started`). Set before the fork server
    starts; a running one keeps what it has.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", ingest_worker.__name__])
    return context


def yield_cpu_to_ingest(niceness: int, ingest_niceness: int) -> None:
    """Run this thread, and every thread it starts later, `niceness` below the ingest
    processes (which run at `ingest_niceness`; Linux's nice is a thread's, elsewhere the
    process's): the collector's event loop, after its ingest processes started, so its
    reads and their threads yield the CPU to the batches when the machine is busy, and take
    all of it when not. Absolute, not relative: a thread that starts a second collector
    (the tests) is not lowered twice.

    Why: on 2 cores, 1,000 closed-loop readers kept the ingest process from a core of its
    own: 15-24 of 32 batches/s stored, ingest p50 1.2-2.0 s, alert p99 3.2-4.7 s; at nice
    10, 26-29 batches/s, alert p99 2.2-2.6 s, and reads 166-171/s against 137-181/s
    (`bench/load.py`, SQLite, 20 s, interleaved on a shared machine)."""
    getpriority = getattr(os, "getpriority", None)  # not on Windows
    if not niceness or getpriority is None:
        return
    target = min(ingest_niceness + niceness, _LOWEST)
    if getpriority(os.PRIO_PROCESS, 0) < target:  # raising it back needs privileges
        os.setpriority(os.PRIO_PROCESS, 0, target)


class IngestPool:
    """The ingest processes of one collector process. Use from its event loop only."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._executor = self._new_executor()

    def _new_executor(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            max_workers=self._settings.ingest_processes,
            mp_context=_context(),
            initializer=ingest_worker.start,
            initargs=(self._settings,),
        )

    async def started(self) -> int:
        """Wait until an ingest process runs (its initializer passed), so the first batch
        does not wait for it, and return its nice value; raises what the initializer
        raised."""
        try:
            return await asyncio.wrap_future(self._executor.submit(ingest_worker.ready))
        except BrokenProcessPool as error:
            raise RuntimeError(
                "the collector's ingest process did not start (see the error above); a "
                'script that starts a collector needs `if __name__ == "__main__":`'
            ) from error

    async def submit(self, call: ingest_worker.Call) -> ingest_worker.Outcome:
        """Store one batch in an ingest process; its log records are emitted here."""
        executor = self._executor
        try:
            answer = await asyncio.wrap_future(executor.submit(ingest_worker.run, call))
        except BrokenProcessPool:
            if executor is self._executor:  # the first of its batches to hear it
                logger.error("an ingest process stopped; a new one takes the next batch")
                self._executor = self._new_executor()
                executor.shutdown(wait=False, cancel_futures=True)
            return ingest_worker.Refused(503, PROCESS_DIED, RETRY_AFTER)
        ingest_worker.replay(answer.logs)
        return answer.outcome

    def close(self) -> None:
        """Let the batches being stored finish, then stop the processes."""
        self._executor.shutdown(wait=True)
