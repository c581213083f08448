"""The commands that call a running collector's `/api/v1` over HTTP: `ampwatch
restart-candidates`, `resume-plan` (`ampwatch.server.cli.resume`) and `ampwatch webhook
add|list|remove|test`. A run is named by id,
client run id or name (`resolve_run`); a collector's refusal is a message and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where a command runs: building the parser needs neither
    import httpx


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `restart-candidates` and `webhook` to the `ampwatch` subparsers `sub`."""

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

    from ampwatch.server.cli import resume  # it imports this module's client helpers

    resume.add_commands(sub, add_api)


class _ApiError(Exception):
    """A collector answer or failure to explain to the user (exit status 1)."""


def _api(args: argparse.Namespace) -> httpx.Client:
    """A client for the collector's `/api/v1` at --url (AMPWATCH_URL), sending --token
    (AMPWATCH_TOKEN) when given."""
    import httpx

    from ampwatch.agent.config import from_environment
    from ampwatch.agent.wire import API_PREFIX
    from ampwatch.server.settings import Settings

    url = args.url or from_environment("URL") or Settings().public_url
    token = args.token or from_environment("TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=url.rstrip("/") + API_PREFIX, headers=headers, timeout=30.0)


def _call(api: httpx.Client, method: str, path: str, **kwargs: object) -> httpx.Response:
    import httpx

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


def get_of_run(args: argparse.Namespace, command: str, resource: str) -> Any:
    """GET `/runs/{id}/{resource}` of the run `args.run` names; None (the reason printed
    to stderr as `ampwatch COMMAND: ...`) when the collector refuses or is unreachable."""
    try:
        with _api(args) as api:
            run_id = resolve_run(api, args.run)
            return _call(api, "GET", f"/runs/{run_id}/{resource}").json()
    except _ApiError as error:
        print(f"ampwatch {command}: {error}", file=sys.stderr)
        return None


def cmd_restart_candidates(args: argparse.Namespace) -> int:
    answer = get_of_run(args, "restart-candidates", "restart-candidates")
    if answer is None:
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
