"""The operator's commands on the collector's host: `ampwatch db`, `age-layer-stats`,
`fetch-plotly` (the schema, the raw layer samples' age, the dashboard's plotly.js)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ampwatch.server.cli.options import add_database_url, settings_from


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `db`, `age-layer-stats` and `fetch-plotly` to the `ampwatch` subparsers `sub`."""
    db = sub.add_parser("db", help="schema migrations (Alembic)")
    db.add_argument("action", choices=["upgrade", "downgrade"])
    db.add_argument("revision", nargs="?", help="target revision (upgrade: head; downgrade: base)")
    add_database_url(db)
    db.set_defaults(func=cmd_db)

    age = sub.add_parser(
        "age-layer-stats",
        help="delete raw layer samples older than the last N steps of long runs (rollups kept)",
    )
    age.add_argument(
        "--keep-steps", type=int, help="steps kept raw (AMPWATCH_LAYER_RAW_KEEP_STEPS)"
    )
    add_database_url(age)
    age.set_defaults(func=cmd_age_layer_stats)

    fetch = sub.add_parser(
        "fetch-plotly",
        help="download plotly.js's cartesian bundle (npm) that makes the dashboard load faster",
        description="The dashboard serves it instead of the full 4.8 MB plotly.js when present; "
        "the download is checked against a pinned sha512.",
    )
    fetch.add_argument(
        "--dir",
        help="where to store it (AMPWATCH_ASSETS_DIR, default <python prefix>/share/ampwatch)",
    )
    fetch.add_argument(
        "--optional",
        action="store_true",
        help="a failed download is a warning and exit status 0 (an image built offline); "
        "any other failure is still an error",
    )
    fetch.set_defaults(func=cmd_fetch_plotly)


def cmd_db(args: argparse.Namespace) -> int:
    from ampwatch.server import migrate

    settings = settings_from(args)
    if args.action == "upgrade":
        migrate.upgrade(settings.database_url, args.revision or "head")
    else:
        migrate.downgrade(settings.database_url, args.revision or "base")
    from sqlalchemy.engine import make_url

    database = make_url(settings.database_url).render_as_string(hide_password=True)
    print(f"database {database}: {args.action} done")
    return 0


def cmd_age_layer_stats(args: argparse.Namespace) -> int:
    from ampwatch.server.db import make_engine, make_sessionmaker
    from ampwatch.server.layer_rollups import age_runs

    settings = settings_from(args)
    keep = args.keep_steps if args.keep_steps is not None else settings.layer_raw_keep_steps
    if keep is None:
        print("set --keep-steps or AMPWATCH_LAYER_RAW_KEEP_STEPS", file=sys.stderr)
        return 2
    engine = make_engine(settings.database_url)
    try:
        aged = age_runs(make_sessionmaker(engine), keep)
    finally:
        engine.dispose()
    for run_id, deleted in aged.items():
        print(f"run {run_id}: {deleted} raw layer rows aged into rollups")
    print(f"{len(aged)} run(s) aged, raw samples of the last {keep} steps kept")
    return 0


def cmd_fetch_plotly(args: argparse.Namespace) -> int:
    import httpx

    from ampwatch.dashboard import plotly_bundle

    folder = Path(args.dir) if args.dir else None
    try:
        path = plotly_bundle.fetch(folder)
    except (httpx.HTTPError, ValueError, OSError) as exc:
        print(
            f"could not fetch plotly.js's cartesian bundle ({exc}); the dashboard serves "
            "the full bundle instead",
            file=sys.stderr,
        )
        return 0 if args.optional else 1
    print(f"plotly.js {plotly_bundle.VERSION} cartesian bundle: {path}")
    return 0
