"""The `ampwatch` command: `serve`, `demo`, `db upgrade|downgrade`.

argparse rather than a CLI framework: four subcommands do not justify a dependency, and
the collector host installs as little as possible.
"""

from __future__ import annotations

import argparse
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
