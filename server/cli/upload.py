"""`ampwatch upload`: an offline file or a left-behind spool sent through the agent's
uploader (`ampwatch.agent.upload`), not the API client of `remote.py`: batches keep their
(run, stream, seq), so a second upload stores nothing twice."""

from __future__ import annotations

import argparse
import os
import sys

from ampwatch.agent import config


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `upload` to the `ampwatch` subparsers `sub`."""
    upload = sub.add_parser(
        "upload",
        help="send an offline file, or a spool directory left behind, to a collector",
        description="Batches carry their (run, stream, seq): uploading twice stores nothing twice.",
    )
    upload.add_argument("path", help="offline file (AMPWATCH_OFFLINE_FILE) or spool directory")
    upload.add_argument("--url", help="collector URL (AMPWATCH_URL, default http://127.0.0.1:8765)")
    upload.add_argument("--token", help="project token (AMPWATCH_TOKEN)")
    upload.set_defaults(func=cmd_upload)


def cmd_upload(args: argparse.Namespace) -> int:
    from ampwatch.agent.upload import upload

    if not os.path.exists(args.path):
        print(f"ampwatch upload: {args.path} does not exist", file=sys.stderr)
        return 2
    # As the agent and `ampwatch import` resolve them: an agent-only install has no Settings.
    target = config.resolve(url=args.url, token=args.token)
    url = target.url
    report = upload(args.path, url, token=target.token)
    print(
        f"{args.path} -> {url}: {report.stored} batches stored, {report.duplicates} "
        f"already there, {report.rejected} rejected, {report.corrupt} unreadable, "
        f"{report.unsent} not sent"
        + (f"; {report.removed} delivered spool files removed" if report.removed else "")
    )
    return 0 if report.complete else 1
