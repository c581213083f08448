"""The `ampwatch` command: `serve`, `demo`, `db upgrade|downgrade`, `token create|list|revoke`.

argparse rather than a CLI framework: four subcommands do not justify a dependency, and
the collector host installs as little as possible.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import httpx

from ampwatch.server.settings import Settings


def _settings(args: argparse.Namespace) -> Settings:
    """Settings from the environment (AMPWATCH_*), overridden by explicit flags."""
    overrides = {
        key: value
        for key, value in {
            "host": getattr(args, "host", None),
            "port": getattr(args, "port", None),
            "database_url": getattr(args, "database_url", None),
        }.items()
        if value is not None
    }
    if getattr(args, "no_dashboard", False):
        overrides["dashboard"] = False
    return Settings(**overrides)


def _collector_is_up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def cmd_serve(args: argparse.Namespace) -> int:
    from ampwatch.server.serving import serve

    settings = _settings(args)
    print(
        f"ampwatch collector on {settings.public_url} "
        f"(dashboard {settings.public_url}/dashboard/, database {settings.database_url})"
    )
    serve(settings)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    try:
        from ampwatch.server.demo import run_demo
    except ImportError as exc:  # pragma: no cover - depends on the install
        print(
            f"ampwatch demo needs torch ({exc}); install it with: pip install 'ampwatch[all]'",
            file=sys.stderr,
        )
        return 2
    from ampwatch.server.serving import BackgroundCollector

    settings = _settings(args)
    url = settings.public_url
    collector = None
    if _collector_is_up(url):
        print(f"Using the collector already running at {url}")
    else:
        print(f"Starting the collector at {url} (database {settings.database_url})")
        collector = BackgroundCollector(settings).start()
    print(f"Dashboard: {url}/dashboard/", flush=True)
    run_demo(url, steps=args.steps)
    print(f"\nDemo runs are in. Dashboard: {url}/dashboard/", flush=True)
    if collector is not None:
        if args.exit:
            collector.stop()
            return 0
        print("Serving until you stop it (Ctrl-C).", flush=True)
        try:
            collector.wait()
        except KeyboardInterrupt:
            collector.stop()
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    from ampwatch.server import migrate

    settings = _settings(args)
    if args.action == "upgrade":
        migrate.upgrade(settings.database_url, args.revision or "head")
    else:
        migrate.downgrade(settings.database_url, args.revision or "base")
    print(f"database {settings.database_url}: {args.action} done")
    return 0


def cmd_upload(args: argparse.Namespace) -> int:
    from ampwatch.agent.upload import upload

    if not os.path.exists(args.path):
        print(f"ampwatch upload: {args.path} does not exist", file=sys.stderr)
        return 2
    url = args.url or os.environ.get("AMPWATCH_URL") or _settings(args).public_url
    token = args.token or os.environ.get("AMPWATCH_TOKEN")
    report = upload(args.path, url, token=token)
    print(
        f"{args.path} -> {url}: {report.stored} batches stored, {report.duplicates} "
        f"already there, {report.rejected} rejected, {report.corrupt} unreadable, "
        f"{report.unsent} not sent"
    )
    return 0 if report.complete else 1


def cmd_token(args: argparse.Namespace) -> int:
    from ampwatch.server import auth, migrate
    from ampwatch.server.db import make_engine, make_sessionmaker

    settings = _settings(args)
    migrate.upgrade(settings.database_url)  # a first command on a fresh database works too
    engine = make_engine(settings.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            if args.action == "create":
                issued = auth.create_token(session, project=args.project, name=args.name or "")
                scope = f"project {issued.project!r}" if issued.project else "every project"
                print(f"token {issued.prefix} ({issued.name}) for {scope}; shown only now:")
                print(issued.token)
            elif args.action == "revoke":
                if not auth.revoke_token(session, args.prefix):
                    print(f"no token {args.prefix!r}; see: ampwatch token list", file=sys.stderr)
                    return 1
                print(f"token {args.prefix} revoked")
            else:
                for info in auth.list_tokens(session):
                    state = f"revoked {info.revoked_at:%Y-%m-%d}" if info.revoked_at else "active"
                    project = info.project or "(admin: every project)"
                    print(f"{info.prefix}  {project}  {info.name}  {state}")
    finally:
        engine.dispose()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ampwatch",
        description="Training-health monitor for mixed-precision PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add_connection(p: argparse.ArgumentParser) -> None:
        p.add_argument("--host", help="interface to bind (AMPWATCH_HOST, default 127.0.0.1)")
        p.add_argument("--port", type=int, help="port (AMPWATCH_PORT, default 8765)")
        p.add_argument(
            "--database-url",
            help="SQLAlchemy URL (AMPWATCH_DATABASE_URL; default an SQLite file in ./.ampwatch/)",
        )

    serve = sub.add_parser("serve", help="run the collector and its dashboard")
    add_connection(serve)
    serve.add_argument(
        "--no-dashboard",
        action="store_true",
        help="serve only the API (run the dashboard on its own)",
    )
    serve.set_defaults(func=cmd_serve)

    demo = sub.add_parser("demo", help="train three small FP16 runs into a collector")
    add_connection(demo)
    demo.add_argument("--steps", type=int, default=300, help="steps per run (default 300)")
    demo.add_argument(
        "--exit", action="store_true", help="stop the collector it started when the runs are in"
    )
    demo.set_defaults(func=cmd_demo)

    db = sub.add_parser("db", help="schema migrations (Alembic)")
    db.add_argument("action", choices=["upgrade", "downgrade"])
    db.add_argument("revision", nargs="?", help="target revision (upgrade: head; downgrade: base)")
    db.add_argument("--database-url", help="SQLAlchemy URL (AMPWATCH_DATABASE_URL)")
    db.set_defaults(func=cmd_db)

    token = sub.add_parser("token", help="API tokens: create, list, revoke")
    token_sub = token.add_subparsers(dest="action", required=True)
    create = token_sub.add_parser("create", help="create a token and print it (once)")
    scope = create.add_mutually_exclusive_group(required=True)
    scope.add_argument("--project", help="the project whose runs the token reads and writes")
    scope.add_argument(
        "--admin", action="store_true", help="a token for every project (operators, /metrics)"
    )
    create.add_argument("--name", help="a label shown by `ampwatch token list`")
    token_sub.add_parser("list", help="list tokens (their public prefixes; never secrets)")
    revoke = token_sub.add_parser("revoke", help="revoke a token by its prefix")
    revoke.add_argument("prefix", help="the token's prefix, as `ampwatch token list` shows")
    for p in token_sub.choices.values():
        p.add_argument("--database-url", help="SQLAlchemy URL (AMPWATCH_DATABASE_URL)")
    token.set_defaults(func=cmd_token)

    upload = sub.add_parser(
        "upload",
        help="send an offline file, or a spool directory left behind, to a collector",
        description="Batches carry their (run, stream, seq): uploading twice stores nothing twice.",
    )
    upload.add_argument("path", help="offline file (AMPWATCH_OFFLINE_FILE) or spool directory")
    upload.add_argument("--url", help="collector URL (AMPWATCH_URL, default http://127.0.0.1:8765)")
    upload.add_argument("--token", help="project token (AMPWATCH_TOKEN)")
    upload.set_defaults(func=cmd_upload)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
