"""Serve the dashboard on its own, against a collector elsewhere::

python -m ampwatch.dashboard --api-url http://collector:8000 --port 8050
"""

from __future__ import annotations

import argparse

from ampwatch.dashboard.app import create_dash_app


def _dashboard_token() -> str | None:
    from ampwatch.server.settings import Settings  # the one reader of AMPWATCH_*

    token = Settings().dashboard_token
    return None if token is None else token.get_secret_value()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ampwatch.dashboard", description="ampwatch dashboard"
    )
    parser.add_argument("--api-url", required=True, help="the collector, e.g. http://host:8000")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8050)
    parser.add_argument(
        "--prefix", default="/", help="URL prefix when served behind a proxy, e.g. /dashboard/"
    )
    parser.add_argument(
        "--token",
        default=_dashboard_token(),
        help="bearer token for the collector (default: AMPWATCH_DASHBOARD_TOKEN); the "
        "dashboard shows whatever this token may read",
    )
    args = parser.parse_args(argv)
    app = create_dash_app(args.api_url, requests_pathname_prefix=args.prefix, token=args.token)
    app.run(host=args.host, port=args.port, debug=False)


if __name__ == "__main__":
    main()
