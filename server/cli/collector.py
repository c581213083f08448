"""`ampwatch serve` and `ampwatch demo`: run the collector, in the foreground or behind
the demo's training runs."""

from __future__ import annotations

import argparse
import sys

from ampwatch.agent.wire import DASHBOARD_PREFIX
from ampwatch.server.cli.options import settings_from


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `serve` and `demo` to the `ampwatch` subparsers `sub`."""

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
    serve.add_argument(
        "--workers",
        type=int,
        help="collector processes sharing the port (AMPWATCH_WORKERS, default 1); "
        "more than one needs PostgreSQL",
    )
    serve.add_argument(
        "--no-migrate",
        action="store_true",
        help="do not apply migrations on start (AMPWATCH_MIGRATE=false): several "
        "collectors on one database run `ampwatch db upgrade` once, beforehand",
    )
    serve.set_defaults(func=cmd_serve)

    demo = sub.add_parser("demo", help="train three small FP16 runs into a collector")
    add_connection(demo)
    demo.add_argument("--steps", type=int, default=300, help="steps per run (default 300)")
    demo.add_argument(
        "--exit", action="store_true", help="stop the collector it started when the runs are in"
    )
    demo.set_defaults(func=cmd_demo)


def _collector_is_up(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def cmd_serve(args: argparse.Namespace) -> int:
    from sqlalchemy.engine import make_url

    from ampwatch.server.serving import serve

    settings = settings_from(args)
    dashboard = (
        f"dashboard {settings.public_url}{DASHBOARD_PREFIX}/"
        if settings.dashboard
        else ("no dashboard")
    )
    # The URL's password (PostgreSQL) stays out of the logs.
    database = make_url(settings.database_url).render_as_string(hide_password=True)
    print(
        f"ampwatch collector on {settings.public_url} ({dashboard}, "
        f"{settings.workers} worker{'s' if settings.workers > 1 else ''}, database {database})",
        flush=True,
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

    settings = settings_from(args)
    url = settings.public_url
    collector = None
    if _collector_is_up(url):
        print(f"Using the collector already running at {url}")
    else:
        print(f"Starting the collector at {url} (database {settings.database_url})")
        collector = BackgroundCollector(settings).start()
    print(f"Dashboard: {url}{DASHBOARD_PREFIX}/", flush=True)
    run_demo(url, steps=args.steps)
    print(f"\nDemo runs are in. Dashboard: {url}{DASHBOARD_PREFIX}/", flush=True)
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
