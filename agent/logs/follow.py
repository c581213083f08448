"""`ampwatch follow`: stream a log being written into the collector, through the agent's
own sender (`ampwatch.agent.transport.Sender`): batching, retries, the on-disk spool
while the collector is down, and (run, stream, seq) dedup, so every step arrives once.

Each process of the training run (the log's first, and each restart the parser sees) gets
its own sender, stream and spool folder (`<run's spool dir>/process-N`), exactly as a
resumed agent would, so the collector restarts its calibration at the new process's
`run_start`. At a restart the old sender is closed (flushed); what it could not deliver
(the collector is down) stays in its spool folder, which the follower uploads before
anything of the new process goes out: the new sender's transport refuses while that
backlog exists (its batches wait in its own spool, in order), so the collector sees the
processes in log order. Ctrl-C (SIGINT) or SIGTERM: the parser's last steps are sent, the
senders flushed, exit 0; a backlog left then is sent by the next `follow` of the same
log, or by `ampwatch upload DIR`.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from ampwatch.agent import wire
from ampwatch.agent.delivery import DeliveryOptions
from ampwatch.agent.logs.detect import SNIFF_LINES, Sniffer, make_parser
from ampwatch.agent.logs.reader import LineReader, findings
from ampwatch.agent.logs.records import (
    Target,
    derived_id,
    event,
    run_start,
    scaler_history,
    step_sample,
)
from ampwatch.agent.logs.series import Checkpoint, Entry, Finding, LogStep, Restart
from ampwatch.agent.logs.tail import LogTail
from ampwatch.agent.spool import default_spool_dir
from ampwatch.agent.transport import Sender, Transport, http_transport
from ampwatch.agent.upload import upload

#: Seconds between tries to upload an earlier process's backlog.
BACKLOG_RETRY = 2.0


class Follower:
    """Reads what is new in the log at each `tick()` and hands it to the senders; never
    blocks on the network (the senders' threads do that).

    >>> follower = Follower("train.log", Target("http://127.0.0.1:8765"))  # doctest: +SKIP
    >>> follower.tick(); follower.close()  # doctest: +SKIP
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        target: Target,
        *,
        fmt: str = "auto",
        transport: Transport | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
        flush_interval: float = 1.0,
        from_end: bool = False,
        log: Callable[[str], None] = print,
    ) -> None:
        self.path = Path(path)
        self.tail = LogTail(path, from_end=from_end)
        self._fmt = fmt
        self.format: str | None = None if fmt == "auto" else fmt
        self._parser: LineReader | None = None if fmt == "auto" else LineReader(make_parser(fmt))
        self._sniffed: list[tuple[int, str]] = []
        self._sniffer = Sniffer()
        self._number = 0
        self._base_id = target.run_id or derived_id("ampwatch-follow", str(self.path.resolve()))
        self._name = target.name or self.path.stem
        self._project = target.project
        self._token = target.token
        self._url = target.url
        self._transport = transport or http_transport(target.url)
        self._spool_dir = spool_dir
        self._flush_interval = flush_interval
        self._log = log
        self._senders: dict[str, Sender] = {}
        self._process = 0
        self._restart_reason = "follow started"
        self._backlog: list[Path] = []  # closed processes' spool folders not yet delivered
        self._backlog_at = 0.0
        self.steps_sent = 0
        self._last_step: int | None = None

    def client_run_id(self, engine: str = "") -> str:
        return self._base_id if not engine else derived_id(self._base_id, engine)

    def tick(self) -> int:
        """Read and send what the log gained; returns the steps handed to the senders."""
        before = self.steps_sent
        self._deliver_backlog()
        for line in self.tail.poll():
            self._number += 1
            if self._parser is None:
                self._sniff(line)
            else:
                self._send(self._parser.feed(line, self._number))
        return self.steps_sent - before

    def _sniff(self, line: str) -> None:
        """Auto: hold lines until a format's markers show (counted as they arrive, never
        read again); lines that carry no marker before the first one are launcher noise,
        dropped once SNIFF_LINES of them are held."""
        self._sniffed.append((self._number, line))
        self._sniffer.add(line)
        decided = self._sniffer.decide(final=False)
        if decided is None:
            if len(self._sniffed) >= SNIFF_LINES and not self._sniffer.generic:
                self._sniffed = []
            return
        self._start_parser(*decided)

    def _start_parser(self, fmt: str, why: str) -> None:
        self.format = fmt
        self._log(f"{self.path}: format {fmt} ({why})")
        self._parser = LineReader(make_parser(fmt))
        held, self._sniffed = self._sniffed, []
        for number, text in held:
            self._send(self._parser.feed(text, number))

    def _sender(self, engine: str, first: LogStep | None = None) -> Sender:
        sender = self._senders.get(engine)
        if sender is None:
            ref: wire.RunRef = {"client_run_id": self.client_run_id(engine),
                                "name": f"{self._name}-{engine}" if engine else self._name}  # fmt: skip
            if self._project is not None:
                ref["project"] = self._project
            delivery = DeliveryOptions(spool_dir=self._process_spool(engine))
            sender = Sender(ref, self._in_order, token=self._token, delivery=delivery,
                            flush_interval=self._flush_interval)  # fmt: skip
            sender.start()
            fmt = self.format or self._fmt
            numbered = self._parser is None or "step" not in self._parser.inferred
            sender.put(run_start(fmt, str(self.path), self._process, self._restart_reason,
                                 scaler_history(fmt, first, numbered=numbered)))  # fmt: skip
            self._senders[engine] = sender
        return sender

    def _process_spool(self, engine: str) -> Path:
        root = Path(self._spool_dir) if self._spool_dir else default_spool_dir(
            self.client_run_id(engine))  # fmt: skip
        return root / f"process-{self._process}"

    def _in_order(self, body: bytes, headers: dict[str, str]) -> int:
        """The senders' transport: nothing of a later process while an earlier one's
        batches wait (raising is "not delivered": the sender retries, then spools)."""
        if self._backlog:
            raise ConnectionError("an earlier process's batches are delivered first")
        return self._transport(body, headers)

    def _deliver_backlog(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not self._backlog or (not force and now < self._backlog_at):
            return
        self._backlog_at = now + BACKLOG_RETRY
        while self._backlog:
            folder = self._backlog[0]
            report = upload(folder, self._url, token=self._token, timeout=5.0, attempts=1,
                            log=lambda _: None)  # fmt: skip
            if not report.complete:
                return
            shutil.rmtree(folder, ignore_errors=True)
            self._backlog.pop(0)

    def _send(self, entries: list[Entry]) -> None:
        for entry in entries:
            if isinstance(entry, Restart):
                self._log(f"{self.path}:{entry.line}: a new process ({entry.reason})")
                self._close_senders(timeout=10.0)
                self._process += 1
                self._restart_reason = f"restart at line {entry.line}: {entry.reason}"
            elif isinstance(entry, LogStep):
                self._sender(entry.engine, entry).put(step_sample(entry))
                self.steps_sent += 1
                self._last_step = entry.step
            elif isinstance(entry, Checkpoint):
                self._sender(entry.engine).put(
                    event("checkpoint", entry.step, {"path": entry.path})
                )
            elif isinstance(entry, Finding):
                self._sender(entry.engine).put(event("finding", entry.step, entry.data))

    def _close_senders(self, timeout: float) -> bool:
        delivered = True
        for engine, sender in self._senders.items():  # every one, even after one that failed
            if not sender.close(timeout):
                delivered = False
                self._backlog.append(self._process_spool(engine))
        self._senders = {}
        return delivered

    def close(self, timeout: float = 10.0) -> bool:
        """Send the parser's last steps and flush; True if all reached the collector (else
        the rest is in the spool)."""
        if self._parser is None and self._sniffed:
            decided = self._sniffer.decide(final=True)
            if decided is not None:
                self._start_parser(*decided)
        if self._parser is not None:
            self._send(self._parser.finish())
            self._send([Finding(f["step"], f["data"], engine) for engine in list(self._senders)
                        for f in findings(self._parser.unread, self._parser.inferred,
                                          self._last_step, 0.0)])  # fmt: skip
            if self._parser.unread.total:
                self._log(f"{self.path}: {self._parser.unread.summary()}")
        self.tail.close()
        self._deliver_backlog(force=True)
        return self._close_senders(timeout) and not self._backlog


def follow(follower: Follower, *, poll_interval: float = 0.25,
           stop: threading.Event | None = None) -> int:  # fmt: skip
    """The CLI loop: tick every `poll_interval` seconds until SIGINT/SIGTERM (or `stop`),
    then flush. Returns the exit status (0 after a clean stop)."""
    stop = stop or threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, on_signal)
    try:
        while not stop.is_set():
            started = time.monotonic()
            follower.tick()
            stop.wait(max(0.0, poll_interval - (time.monotonic() - started)))
    finally:
        delivered = follower.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    print(f"{follower.path}: {follower.steps_sent} steps sent"
          + ("" if delivered else "; the rest is spooled (sent when the collector is back)"),
          flush=True)  # fmt: skip
    return 0
