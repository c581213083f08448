"""The `ampwatch` command: `serve`, `demo`, `db upgrade|downgrade`, `token create|list|revoke`,
`upload`, `import`, `follow` (training logs: `ampwatch.agent.logs.cli`), `restart-candidates`,
`webhook add|list|remove|test`.

argparse rather than a CLI framework: four subcommands do not justify a dependency, and
the collector host installs as little as possible.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

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
            "workers": getattr(args, "workers", None),
        }.items()
        if value is not None
    }
    if getattr(args, "no_dashboard", False):
        overrides["dashboard"] = False
    if getattr(args, "no_migrate", False):
        overrides["migrate"] = False
    return Settings(**overrides)


def _collector_is_up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def cmd_serve(args: argparse.Namespace) -> int:
    from sqlalchemy.engine import make_url

    from ampwatch.server.serving import serve

    settings = _settings(args)
    dashboard = (
        f"dashboard {settings.public_url}/dashboard/" if settings.dashboard else ("no dashboard")
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
    from sqlalchemy.engine import make_url

    database = make_url(settings.database_url).render_as_string(hide_password=True)
    print(f"database {database}: {args.action} done")
    return 0


def cmd_age_layer_stats(args: argparse.Namespace) -> int:
    from ampwatch.server.db import make_engine, make_sessionmaker
    from ampwatch.server.layer_rollups import age_runs

    settings = _settings(args)
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
        return 1
    print(f"plotly.js {plotly_bundle.VERSION} cartesian bundle: {path}")
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
        + (f"; {report.removed} delivered spool files removed" if report.removed else "")
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


class _ApiError(Exception):
    """A collector answer or failure to explain to the user (exit status 1)."""


def _api(args: argparse.Namespace) -> httpx.Client:
    """A client for the collector's `/api/v1` at --url (AMPWATCH_URL), sending --token
    (AMPWATCH_TOKEN) when given."""
    url = args.url or os.environ.get("AMPWATCH_URL") or Settings().public_url
    token = args.token or os.environ.get("AMPWATCH_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=f"{url.rstrip('/')}/api/v1", headers=headers, timeout=30.0)


def _call(api: httpx.Client, method: str, path: str, **kwargs: object) -> httpx.Response:
    try:
        response = api.request(method, path, **kwargs)  # type: ignore[arg-type]
    except httpx.HTTPError as error:
        raise _ApiError(f"cannot reach the collector at {api.base_url}: {error}") from None
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise _ApiError(f"{method} {path}: HTTP {response.status_code}: {detail}")
    return response


def resolve_run(api: httpx.Client, ref: str) -> int:
    """The id of the run `ref` names: a numeric id, else a client run id, else a name
    (which must then be unique among the runs this token sees)."""
    if ref.isdigit():
        try:
            return int(_call(api, "GET", f"/runs/{ref}").json()["id"])
        except _ApiError as error:
            if "HTTP 404" not in str(error):
                raise
    by_client, by_name = [], []
    offset = 0
    while True:
        page = _call(api, "GET", "/runs", params={"limit": 1000, "offset": offset}).json()
        for run in page["runs"]:
            if run["client_run_id"] == ref:
                by_client.append(run)
            elif run["name"] == ref:
                by_name.append(run)
        offset += len(page["runs"])
        if not page["runs"] or offset >= page["total"]:
            break
    matches = by_client or by_name
    if not matches:
        raise _ApiError(f"no run with id, client run id or name {ref!r}")
    if len(matches) > 1:
        listed = ", ".join(
            f"{run['id']} ({run['client_run_id']}, project {run['project']})" for run in matches
        )
        raise _ApiError(f"{len(matches)} runs are named {ref!r}: ids {listed}; pass the id")
    return int(matches[0]["id"])


def _number(value: object, spec: str) -> str:
    """A wire float for a table: a number formatted, "NaN"/"Infinity" as sent, null as -."""
    if value is None:
        return "-"
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def format_restart_candidates(answer: dict[str, object]) -> str:
    """The advisor's answer as a table with each candidate's reasons under it."""
    onset = (
        f"incident onset at step {answer['onset_step']} ({answer['onset_rule']})"
        if answer["onset_step"] is not None
        else "no incident reached critical"
    )
    lines = [f"run {answer['run_id']}: {onset}; margin {answer['margin_steps']} steps"]
    best = answer["recommended"]
    if isinstance(best, dict):
        lines.append(f"recommended: step {best['step']}  {best['path'] or '(no path)'}")
        skip = answer.get("skip_steps")
        if isinstance(skip, dict):
            lines.append(f"skip data: steps {skip['start']}-{skip['end']} ({skip['reason']})")
    else:
        lines.append("recommended: none (no healthy checkpoint)")
    candidates = answer["candidates"]
    assert isinstance(candidates, list)
    if not candidates:
        lines.append("the run reported no checkpoints")
        return "\n".join(lines)
    lines.append("")
    lines.append(f"{'step':>10}  {'verdict':<11}  {'loss scale':>10}  {'act norm':>9}  path")
    for c in candidates:
        step = "-" if c["step"] is None else str(c["step"])
        scale, norm = _number(c["loss_scale"], ".6g"), _number(c["act_norm"], ".4g")
        lines.append(f"{step:>10}  {c['verdict']:<11}  {scale:>10}  {norm:>9}  {c['path'] or '-'}")
        lines.extend(f"{'':>12}- {reason}" for reason in c["reasons"])
    return "\n".join(lines)


def cmd_restart_candidates(args: argparse.Namespace) -> int:
    try:
        with _api(args) as api:
            run_id = resolve_run(api, args.run)
            answer = _call(api, "GET", f"/runs/{run_id}/restart-candidates").json()
    except _ApiError as error:
        print(f"ampwatch restart-candidates: {error}", file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=2) if args.json else format_restart_candidates(answer))
    return 0


def cmd_webhook(args: argparse.Namespace) -> int:
    try:
        with _api(args) as api:
            if args.action == "add":
                body = {
                    "url": args.webhook_url,
                    "format": args.format,
                    "min_severity": args.min_severity,
                    "project": args.project,
                }
                hook = _call(api, "POST", "/webhooks", json=body).json()
                print(f"webhook {hook['id']} added: {hook['format']} -> {hook['url']}")
            elif args.action == "remove":
                _call(api, "DELETE", f"/webhooks/{args.id}")
                print(f"webhook {args.id} removed")
            elif args.action == "test":
                result = _call(api, "POST", f"/webhooks/{args.id}/test").json()
                print("delivered" if result["delivered"] else f"not delivered: {result['error']}")
                return 0 if result["delivered"] else 1
            else:
                for hook in _call(api, "GET", "/webhooks").json()["webhooks"]:
                    project = hook["project"] or "(every project)"
                    print(
                        f"{hook['id']}  {project}  {hook['format']}  "
                        f">={hook['min_severity']}  {hook['url']}"
                    )
    except _ApiError as error:
        print(f"ampwatch webhook: {error}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    from ampwatch.server.models import TOKEN_SCOPES

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

    db = sub.add_parser("db", help="schema migrations (Alembic)")
    db.add_argument("action", choices=["upgrade", "downgrade"])
    db.add_argument("revision", nargs="?", help="target revision (upgrade: head; downgrade: base)")
    db.add_argument("--database-url", help="SQLAlchemy URL (AMPWATCH_DATABASE_URL)")
    db.set_defaults(func=cmd_db)

    age = sub.add_parser(
        "age-layer-stats",
        help="delete raw layer samples older than the last N steps of long runs (rollups kept)",
    )
    age.add_argument(
        "--keep-steps", type=int, help="steps kept raw (AMPWATCH_LAYER_RAW_KEEP_STEPS)"
    )
    age.add_argument("--database-url", help="SQLAlchemy URL (AMPWATCH_DATABASE_URL)")
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
    fetch.set_defaults(func=cmd_fetch_plotly)

    token = sub.add_parser("token", help="API tokens: create, list, revoke")
    token_sub = token.add_subparsers(dest="action", required=True)
    create = token_sub.add_parser("create", help="create a token and print it (once)")
    scope = create.add_mutually_exclusive_group(required=True)
    scope.add_argument("--project", help="the project whose runs the token may see")
    scope.add_argument("--admin", action="store_true", help="a token for every project (operators)")
    create.add_argument(
        "--scope",
        choices=TOKEN_SCOPES,
        default="write",
        help="write (default): read and write; read: read only (a dashboard); metrics: "
        "scrape /metrics only (a Prometheus; with --admin, every project's series)",
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

    from ampwatch.agent.logs.cli import add_log_commands

    add_log_commands(sub)  # import, follow

    def add_api(p: argparse.ArgumentParser) -> None:
        p.add_argument("--url", help="collector URL (AMPWATCH_URL, default http://127.0.0.1:8765)")
        p.add_argument("--token", help="API token (AMPWATCH_TOKEN)")

    advice = sub.add_parser(
        "restart-candidates",
        help="rank a run's checkpoints for a restart, with the reasons",
    )
    advice.add_argument("run", help="run id, client run id, or run name")
    advice.add_argument("--json", action="store_true", help="print the API's JSON answer")
    add_api(advice)
    advice.set_defaults(func=cmd_restart_candidates)

    webhook = sub.add_parser("webhook", help="alert webhooks: add, list, remove, test")
    webhook_sub = webhook.add_subparsers(dest="action", required=True)
    add = webhook_sub.add_parser("add", help="post alert transitions to URL")
    add.add_argument("webhook_url", metavar="URL", help="http(s) URL of the receiver")
    add.add_argument("--format", choices=["slack", "generic"], default="generic")
    add.add_argument("--project", help="whose alerts (default: the token's project; admin: all)")
    add.add_argument("--min-severity", choices=["info", "warning", "critical"], default="warning")
    webhook_sub.add_parser("list", help="list webhooks")
    for action in ("remove", "test"):
        p = webhook_sub.add_parser(action, help=f"{action} a webhook by its id")
        p.add_argument("id", type=int)
    for p in webhook_sub.choices.values():
        add_api(p)
    webhook.set_defaults(func=cmd_webhook)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
