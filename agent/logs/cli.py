"""The `ampwatch import` and `ampwatch follow` subcommands (registered by
`ampwatch.server.cli`). URL, token and project resolve as the agent's do: flags, else
AMPWATCH_URL / AMPWATCH_TOKEN / AMPWATCH_PROJECT, else defaults (`ampwatch.agent.config`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ampwatch.agent import config
from ampwatch.agent.logs.detect import FORMATS
from ampwatch.agent.logs.records import Target
from ampwatch.agent.logs.series import LogParseError

FORMAT_CHOICES = ["auto", *FORMATS]


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", default="auto", choices=FORMAT_CHOICES,
                   help="the log's format (default: auto, which says what it chose and why)")  # fmt: skip
    p.add_argument("--run", help="run name (default: the file's name)")
    p.add_argument("--run-id", help="client run id (default: derived from the log)")
    p.add_argument("--project", help="project (AMPWATCH_PROJECT; default: the token's)")
    p.add_argument("--url", help="collector URL (AMPWATCH_URL, default http://127.0.0.1:8765)")
    p.add_argument("--token", help="project token (AMPWATCH_TOKEN)")


def add_log_commands(sub: Any) -> None:
    """Add `import` and `follow` to the `ampwatch` subparsers `sub`."""
    imp = sub.add_parser(
        "import",
        help="parse training logs (Megatron, DeepSpeed, HF, fairseq, metaseq, apex, nanoGPT, "
        "DLLogger, XLM, tqdm, generic key/value) into a run",
        description="Parses every file first (a line that does not read is skipped, counted and "
        "stored with the run; nothing is sent if no line reads as a step), then sends the run "
        "as the agent would. Importing the same files again stores nothing twice.",
    )
    imp.add_argument("files", nargs="+", metavar="FILE", help="log files of one run, in order")
    imp.add_argument("--offline", metavar="OUT", help="only write batches to OUT (for upload)")
    _common(imp)
    imp.set_defaults(func=cmd_import)
    fol = sub.add_parser(
        "follow",
        help="stream a log that is being written into a run (Ctrl-C stops cleanly)",
        description="Tails FILE (rotation, truncation, restarts); survives collector outages "
        "through the agent's spool.",
    )
    fol.add_argument("file", metavar="FILE")
    fol.add_argument("--from-end", action="store_true", help="skip what FILE already holds")
    fol.add_argument("--poll", type=float, default=0.25, help="seconds between reads")
    _common(fol)
    fol.set_defaults(func=cmd_follow)


def _target(args: argparse.Namespace) -> Target:
    settings = config.resolve(url=args.url, token=args.token, project=args.project)
    return Target(settings.url, token=settings.token, name=args.run, run_id=args.run_id,
                  project=settings.project)  # fmt: skip


def _needs_agent(command: str) -> int:
    print(f"ampwatch {command} sends through the agent's sender, which needs torch: "
          "pip install 'ampwatch[agent]'", file=sys.stderr)  # fmt: skip
    return 2


def cmd_import(args: argparse.Namespace) -> int:
    try:
        from ampwatch.agent.logs.importer import import_logs
    except ImportError:  # pragma: no cover - depends on the install
        return _needs_agent("import")

    target = _target(args)
    try:
        report = import_logs(args.files, target, fmt=args.format, offline_file=args.offline)
    except (LogParseError, OSError) as exc:
        print(f"ampwatch import: {exc}; nothing was sent", file=sys.stderr)
        return 2
    for run in report.runs:
        print(f"run {run.name} ({run.client_run_id}): {run.steps} steps, "
              f"{len(run.processes)} process(es)")  # fmt: skip
    if report.upload is None:
        print(f"batches written to {args.offline}; send them with: ampwatch upload {args.offline}")
        return 0
    up = report.upload
    print(f"-> {target.url}: {up.stored} batches stored, {up.duplicates} already there, "
          f"{up.rejected} rejected, {up.unsent} not sent"
          + ("" if up.complete else " (run the same import again to finish it)"))  # fmt: skip
    return 0 if up.complete else 1


def cmd_follow(args: argparse.Namespace) -> int:
    try:
        from ampwatch.agent.logs.follow import Follower, follow
    except ImportError:  # pragma: no cover - depends on the install
        return _needs_agent("follow")

    target = _target(args)
    follower = Follower(args.file, target, fmt=args.format, from_end=args.from_end)
    print(f"following {args.file} into run {follower.client_run_id()} at {target.url} "
          "(Ctrl-C stops)", flush=True)  # fmt: skip
    return follow(follower, poll_interval=args.poll)
