"""`ampwatch token create|list|revoke`: API tokens, written straight into the database
(the collector need not run; a fresh database is migrated first)."""

from __future__ import annotations

import argparse
import sys

from ampwatch.server.cli.options import add_database_url, settings_from

#: `models.TOKEN_SCOPES`, spelled out: building the parser must not import SQLAlchemy (an
#: agent-only install runs `ampwatch import`; a test checks the two agree).
SCOPES = ("write", "read", "metrics")


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `token` and its actions to the `ampwatch` subparsers `sub`."""
    token = sub.add_parser("token", help="API tokens: create, list, revoke")
    token_sub = token.add_subparsers(dest="action", required=True)
    create = token_sub.add_parser("create", help="create a token and print it (once)")
    scope = create.add_mutually_exclusive_group(required=True)
    scope.add_argument("--project", help="the project whose runs the token may see")
    scope.add_argument("--admin", action="store_true", help="a token for every project (operators)")
    create.add_argument(
        "--scope",
        choices=SCOPES,
        default="write",
        help="write (default): read and write; read: read only (a dashboard); metrics: "
        "scrape /metrics only (a Prometheus; with --admin, every project's series)",
    )
    create.add_argument("--name", help="a label shown by `ampwatch token list`")
    token_sub.add_parser("list", help="list tokens (their public prefixes; never secrets)")
    revoke = token_sub.add_parser("revoke", help="revoke a token by its prefix")
    revoke.add_argument("prefix", help="the token's prefix, as `ampwatch token list` shows")
    for p in token_sub.choices.values():
        add_database_url(p)
    token.set_defaults(func=cmd_token)


def cmd_token(args: argparse.Namespace) -> int:
    from ampwatch.server import auth, migrate
    from ampwatch.server.db import make_engine, make_sessionmaker

    settings = settings_from(args)
    migrate.upgrade(settings.database_url)  # a first command on a fresh database works too
    engine = make_engine(settings.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            if args.action == "create":
                issued = auth.create_token(
                    session, project=args.project, name=args.name or "", scope=args.scope
                )
                where = f"project {issued.project!r}" if issued.project else "every project"
                print(
                    f"{issued.scope} token {issued.prefix} ({issued.name}) for {where}; "
                    "shown only now:"
                )
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
                    print(f"{info.prefix}  {project}  {info.name}  {state}  {info.scope}")
    finally:
        engine.dispose()
    return 0
