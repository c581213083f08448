"""`ampwatch import`: parse whole logs first, then send them as the agent would.

Nothing is sent until every file has parsed. A line that does not read (cut, not UTF-8,
wrapped) is skipped and counted (`reader.LineReader`): the count is printed at the end and
stored with the run, as is what the parser inferred; only a file in which no line reads as
a step stops the import, with its file and first line. The batches are
then cut deterministically (the run id from the files' bytes, one stream per process, seq
from 0, `BATCH_STEPS` steps a batch), framed as in the agent's offline files and sent
by `ampwatch upload`'s loop (`send`): importing the same files again re-sends the same (run,
stream, seq), which the collector acknowledges as duplicates, storing nothing twice; an
import cut short by an outage is completed by running it again.

Each file is one process of the run (a job's log), and so is each restart inside a file
(`Restart`); a file with two engines (DeepSpeed-Chat's actor and critic) becomes two runs,
`NAME-actor` and `NAME-critic`.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import queue
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ampwatch.agent import wire
from ampwatch.agent.logs.detect import detect_format, make_parser
from ampwatch.agent.logs.reader import LineReader, Unread, findings
from ampwatch.agent.logs.records import (
    Target,
    derived_id,
    event,
    run_start,
    scaler_history,
    wire_step,
)
from ampwatch.agent.logs.series import (
    Checkpoint,
    Entry,
    Finding,
    LogParseError,
    LogStep,
    Restart,
)
from ampwatch.agent.spool import encode_frame
from ampwatch.agent.upload import UploadReport, upload

#: Steps per batch: well under the collector's 50,000 records, large enough that a
#: million-step log is 100 requests.
BATCH_STEPS = 10_000


@dataclass
class ParsedLog:
    """One file, parsed: its format (and why auto chose it), entries in log order."""

    path: str
    format: str
    reason: str
    entries: list[Entry]
    digest: str
    unread: Unread = field(default_factory=Unread)
    inferred: dict[str, str] = field(default_factory=dict)

    @property
    def steps(self) -> list[LogStep]:
        return [e for e in self.entries if isinstance(e, LogStep)]

    @property
    def checkpoints(self) -> list[Checkpoint]:
        return [e for e in self.entries if isinstance(e, Checkpoint)]


def iter_lines(data: bytes, path: str = "") -> Iterator[tuple[int, str]]:
    """(1-based number, text) per line; `\\r\\n` endings lose their `\\r` (a lone `\\r`, a
    tqdm redraw, stays). Bytes that are not UTF-8 become U+FFFD, which the reader counts
    and skips (`reader.LineReader`); a last line without its newline (a killed job's) is
    kept for the parser to judge."""
    lines = data.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    for number, raw in enumerate(lines, 1):
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        yield number, raw.decode("utf-8", errors="replace")


def parse_lines(
    lines: list[tuple[int, str]], fmt: str, path: str = ""
) -> tuple[str, str, list[Entry]]:
    """Parse numbered lines with `fmt` ("auto": detected); (format, reason, entries)."""
    chosen, reason, entries, _ = read_lines(lines, fmt, path)
    return chosen, reason, entries


def read_lines(
    lines: list[tuple[int, str]], fmt: str, path: str = ""
) -> tuple[str, str, list[Entry], LineReader]:
    """`parse_lines`, with the reader (what it could not read, what the parser inferred).
    Raises LogParseError only when no line reads as a step."""
    reason = f"--format {fmt}"
    if fmt == "auto":
        try:
            fmt, reason = detect_format(text for _, text in lines)
        except ValueError as exc:
            first = next(((n, t) for n, t in lines if t.strip()), (1, ""))
            raise LogParseError(first[0], first[1], str(exc), path) from None
    reader = LineReader(make_parser(fmt))
    entries: list[Entry] = []
    for number, text in lines:
        entries += reader.feed(text, number)
    entries += reader.finish()
    if not any(isinstance(e, LogStep) for e in entries):
        first = next(((n, t) for n, t in lines if t.strip()), (1, ""))
        why = f"no line reads as a {fmt} log step"
        if reader.unread.total:
            why += f" ({reader.unread.summary()})"
        raise LogParseError(first[0], first[1], why, path)
    return fmt, reason, entries, reader


def parse_file(path: str | os.PathLike[str], fmt: str = "auto") -> ParsedLog:
    """Parse one log file completely (raises LogParseError naming the line).

    >>> parse_file("train.log").format  # doctest: +SKIP
    'megatron'
    """
    data = Path(path).read_bytes()
    lines = list(iter_lines(data, os.fspath(path)))
    chosen, reason, entries, reader = read_lines(lines, fmt, os.fspath(path))
    return ParsedLog(os.fspath(path), chosen, reason, entries, hashlib.sha256(data).hexdigest(),
                     reader.unread, dict(reader.inferred))  # fmt: skip


@dataclass
class ImportedRun:
    """A run as it will be sent: its processes, each a list of entries."""

    client_run_id: str
    name: str
    processes: list[tuple[str, str, list[Entry]]] = field(
        default_factory=list
    )  # (file, why, entries)

    @property
    def steps(self) -> int:
        return sum(isinstance(e, LogStep) for _, _, p in self.processes for e in p)


def plan_runs(logs: list[ParsedLog], *, name: str | None = None,
              run_id: str | None = None) -> list[ImportedRun]:  # fmt: skip
    """The runs, and their processes, that `logs` (one run's files, in order) hold."""
    base_id = run_id or derived_id("ampwatch-import", *(log.digest for log in logs))
    base_name = name or Path(logs[0].path).stem
    runs: dict[str, ImportedRun] = {}
    for log in logs:
        engines = sorted({e.engine for e in log.entries if isinstance(e, (LogStep, Checkpoint))})
        for engine in engines:
            key = engine or ""
            if key not in runs:
                rid = base_id if not key else derived_id(base_id, key)
                runs[key] = ImportedRun(rid, f"{base_name}-{key}" if key else base_name)
            current: list[Entry] = []
            why = "log file"
            for entry in log.entries:
                if isinstance(entry, Restart):
                    if current:
                        runs[key].processes.append((log.path, why, current))
                    current, why = [], f"restart at line {entry.line}: {entry.reason}"
                elif entry.engine == key:
                    current.append(entry)
            last = next((e.step for e in reversed(current) if isinstance(e, LogStep)), None)
            current += [Finding(f["step"], f["data"], key)
                        for f in findings(log.unread, log.inferred, last, 0.0)]  # fmt: skip
            if current:
                runs[key].processes.append((log.path, why, current))
    return list(runs.values())


def batches(run: ImportedRun, log_format: str, project: str | None, *,
            numbered: bool = True) -> Iterator[bytes]:  # fmt: skip
    """The run's gzip JSON batches, cut deterministically (see the module docstring).
    `numbered`: the log prints its step numbers (else the warm-up of a process is judged
    from its first printed scale, `records.scaler_history`)."""
    ref: wire.RunRef = {"client_run_id": run.client_run_id, "name": run.name}
    if project is not None:
        ref["project"] = project
    for index, (path, why, entries) in enumerate(run.processes):
        stream = derived_id(run.client_run_id, "process", str(index))
        first = next((e for e in entries if isinstance(e, LogStep)), None)
        history = scaler_history(log_format, first, numbered=numbered)
        pending: list[wire.EventRecord] = [run_start(log_format, path, index, why, history)]
        steps: list[wire.StepRecord] = []
        seq = 0
        last = index == len(run.processes) - 1
        for entry in entries:
            if isinstance(entry, LogStep):
                steps.append(wire_step(entry))
            elif isinstance(entry, Checkpoint):
                pending.append(event("checkpoint", entry.step, {"path": entry.path}))
            elif isinstance(entry, Finding):
                pending.append(event("finding", entry.step, entry.data))
            if len(steps) >= BATCH_STEPS:
                yield _body(ref, stream, seq, steps, pending)
                seq, steps, pending = seq + 1, [], []
        if last:
            end_step = next((e.step for e in reversed(entries) if isinstance(e, LogStep)), None)
            pending.append(event("run_end", end_step, {"reason": "the imported log ends"}))
        if steps or pending:
            yield _body(ref, stream, seq, steps, pending)


def _body(ref: wire.RunRef, stream: str, seq: int, steps: list[wire.StepRecord],
          events: list[wire.EventRecord]) -> bytes:  # fmt: skip
    batch: wire.Batch = {"wire_version": wire.WIRE_VERSION, "run": ref, "stream": stream,
                         "seq": seq, "steps": steps, "layer_stats": [], "events": events,
                         "dropped": {}}  # fmt: skip
    return gzip.compress(json.dumps(batch, allow_nan=False).encode(), compresslevel=1)


def send(bodies: Iterator[bytes], url: str, *, token: str | None = None,
         log: Callable[[str], None] = print) -> UploadReport:  # fmt: skip
    """Send `bodies` in order, each through `ampwatch upload`'s loop (its retries and its
    duplicate counting), while this thread builds the next ones: building a batch (JSON,
    gzip) overlaps the collector storing the previous one. Stops at the first batch that
    is not delivered; the rest count as unsent."""
    total = UploadReport()
    ready: queue.Queue[Path | None] = queue.Queue(maxsize=4)
    built = 0

    def post_in_order() -> None:
        while (path := ready.get()) is not None:
            if total.complete:
                part = upload(path, url, token=token, log=log)
                for name in ("stored", "duplicates", "rejected", "corrupt", "unsent"):
                    setattr(total, name, getattr(total, name) + getattr(part, name))
            else:
                total.unsent += 1
            path.unlink()

    with tempfile.TemporaryDirectory(prefix="ampwatch-import-") as folder:
        poster = threading.Thread(target=post_in_order, name="ampwatch-import-send")
        poster.start()
        try:
            for body in bodies:
                path = Path(folder) / f"{built:08d}.ampwatch"
                path.write_bytes(encode_frame(body))
                ready.put(path)
                built += 1
        finally:
            ready.put(None)
            poster.join()
    return total


@dataclass
class ImportReport:
    logs: list[ParsedLog]
    runs: list[ImportedRun]
    upload: UploadReport | None = None


def import_logs(
    paths: list[str],
    target: Target,
    *,
    fmt: str = "auto",
    offline_file: str | None = None,
    log: Callable[[str], None] = print,
) -> ImportReport:
    """Parse every file, then send the runs to `target` (or only write `offline_file`).

    >>> import_logs(["train.log"], Target("http://127.0.0.1:8765")).upload.stored  # doctest: +SKIP
    100
    """
    logs = [parse_file(path, fmt) for path in paths]
    for parsed in logs:
        log(f"{parsed.path}: format {parsed.format} ({parsed.reason}); "
            f"{len(parsed.steps)} steps, {len(parsed.checkpoints)} checkpoints; "
            f"{parsed.unread.summary()}")  # fmt: skip
        if parsed.inferred:
            log(f"{parsed.path}: inferred (the log does not print them): "
                + "; ".join(f"{k}: {v}" for k, v in sorted(parsed.inferred.items())))  # fmt: skip
    runs = plan_runs(logs, name=target.name, run_id=target.run_id)
    report = ImportReport(logs, runs)
    numbered = "step" not in logs[0].inferred
    bodies = (body for run in runs
              for body in batches(run, logs[0].format, target.project, numbered=numbered))  # fmt: skip
    if offline_file is not None:
        with open(offline_file, "ab") as out:
            out.writelines(encode_frame(body) for body in bodies)
    else:
        report.upload = send(bodies, target.url, token=target.token, log=log)
    return report
