"""`/api/v1/...alerts`: alerts, the rule catalogue, and threshold overrides.

A project token reads only its project's alerts and configures only its project (and its
runs); the admin token (or local trust) everything. Overrides are validated against each
rule's settings model: an unknown rule or setting, or a value of the wrong type, is a 422
that names it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from sqlalchemy import Connection, bindparam, exists, func, select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from ampwatch.server import run_version
from ampwatch.server.alerts import RULES, AlertConfigError, validate_overrides
from ampwatch.server.alerts.config import (
    effective_settings,
    file_rules,
    stored_overrides,
    with_file_rules,
)
from ampwatch.server.alerts.rules import RuleName
from ampwatch.server.api import conditional
from ampwatch.server.api.deps import (
    NOT_YOURS,
    RUN_ERRORS,
    PrincipalDep,
    RunAlertsReadDep,
    RunIdDep,
    SessionDep,
    SessionRoute,
    caller_read,
    reads_with_caller,
)
from ampwatch.server.auth import Principal
from ampwatch.server.db import begin_write, dialect_insert
from ampwatch.server.models import Alert, AlertConfig, AlertStatus, Project, Run, Severity, utcnow
from ampwatch.server.schemas.alerts import (
    AlertConfigIn,
    AlertConfigPublic,
    AlertPublic,
    AlertRulePublic,
    AlertRulesPublic,
    AlertsPublic,
)
from ampwatch.server.schemas.wire import MAX_INT

router = APIRouter(route_class=SessionRoute, tags=["alerts"])

DEFAULT_PAGE = 100
MAX_PAGE = 1000

StatusQuery = Annotated[AlertStatus | None, Query(description="pending, firing or resolved.")]
SeverityQuery = Annotated[Severity | None, Query(description="info, warning or critical.")]
# Literal types: FastAPI validates them and documents the 422 it answers (a list detail).
RuleQuery = Annotated[RuleName | None, Query(description="One rule's alerts (see /alert-rules).")]
LimitQuery = Annotated[int, Query(ge=1, le=MAX_PAGE, description="Page size.")]
OffsetQuery = Annotated[int, Query(ge=0, le=MAX_INT, description="Alerts to skip.")]
PROJECT_ERRORS: dict[int | str, dict[str, Any]] = {
    **NOT_YOURS,
    404: {"description": "No such project"},
}


def mount(app: FastAPI, *, prefix: str, **include: Any) -> None:
    """Include the alert routes in `app` and give its sessions the collector's alerts file
    (`settings.alerts_file`, parsed and validated here: a bad file fails startup)."""
    with_file_rules(app.state.sessionmaker, app.state.settings.alerts_file)
    app.include_router(router, prefix=prefix, **include)


def _seconds(moment: datetime | None) -> float | None:
    return moment.timestamp() if moment is not None else None


#: The columns an alert's answer reads (`AlertPublic`'s fields), selected as rows: ORM
#: objects validated by attribute cost ~60 us an alert, a page of 100 ~6 ms.
_COLUMNS = [getattr(Alert, name) for name in AlertPublic.model_fields]


def _page(
    session: Session, conditions: list[Any], limit: int, offset: int, project: str | None = None
) -> AlertsPublic:
    """A page of the alerts matching `conditions` (and of `project`'s runs), newest first.

    A project's page takes one of two plans, chosen by the counts (`_walks_far`): walk the
    alerts newest first, keeping the project's, until the page is full; or take all of the
    project's alerts by run and sort them. The walk suits a project with most of the alerts
    (as a join, SQLite sorted them all: 23 ms for 100 of 8,192 in `bench/load.py`, 0.2 ms
    walking); the sort, one with few (walking 200,000 alerts to find 10 took 47 ms on
    SQLite and 32 ms on PostgreSQL, whose planner walked either way; 0.3 ms sorted).
    """
    count = select(func.count()).select_from(Alert).where(*conditions)
    query = select(*_COLUMNS).where(*conditions)
    newest_first = Alert.id.desc()
    if project is not None:
        count = count.join(Run, Run.id == Alert.run_id).where(Run.project == project)
    total = session.scalar(count) or 0
    if project is not None:
        if _walks_far(session, total, offset + limit):
            query = query.join(Run, Run.id == Alert.run_id).where(Run.project == project)
            newest_first = (Alert.id + 0).desc()  # not the primary key's order: no walk
        else:
            query = query.where(exists().where(Run.id == Alert.run_id, Run.project == project))
    rows = session.execute(query.order_by(newest_first).limit(limit).offset(offset))
    alerts = [row._asdict() for row in rows]
    return AlertsPublic.model_validate(
        {"alerts": alerts, "total": total, "limit": limit, "offset": offset}
    )


def _walks_far(session: Session, matching: int, wanted: int) -> bool:
    """Whether walking the alerts newest first would read more rows than the `matching`
    ones a sort reads: with the matches spread evenly over the id range, the walk reads
    about `wanted` x range / `matching` (the range's ends are two primary-key reads)."""
    # Two subqueries: SQLite reads min and max from the primary key only one at a time.
    ends = (select(f(Alert.id)).scalar_subquery() for f in (func.min, func.max))
    low, high = session.execute(select(*ends)).one()
    span = (high - low + 1) if high is not None else 0
    return wanted * span > matching * matching


def _filters(status: str | None, severity: str | None, rule: str | None) -> list[Any]:
    conditions: list[Any] = []
    if status is not None:
        conditions.append(Alert.status == status)
    if severity is not None:
        conditions.append(Alert.severity == severity)
    if rule is not None:
        conditions.append(Alert.rule == rule)
    return conditions


@router.get("/runs/{run_id}/alerts", responses=RUN_ERRORS)
def run_alerts(
    run_id: RunAlertsReadDep,
    session: SessionDep,
    status: StatusQuery = None,
    rule: RuleQuery = None,
    severity: SeverityQuery = None,
    limit: LimitQuery = DEFAULT_PAGE,
    offset: OffsetQuery = 0,
) -> AlertsPublic:
    """The run's alerts, newest first, optionally filtered. Tagged by its alerts counter,
    which every write of its alerts bumps (`run_version.bump_alerts`)."""
    conditions = [Alert.run_id == run_id, *_filters(status, severity, rule)]
    return _page(session, conditions, limit, offset)


#: `_alerts_version`'s statements, built once from table columns (as `auth._TOKEN_BY_PREFIX`:
#: every poll of an alerts list reads one, and building it took more than running it).
_PROJECTS = Project.__table__.c
_ALL_ALERTS_VERSION = select(func.coalesce(func.sum(_PROJECTS.alerts_version), 0))
_PROJECT_ALERTS_VERSION = select(_PROJECTS.id, _PROJECTS.alerts_version).where(
    _PROJECTS.name == bindparam("project")
)


def _alerts_version(connection: Connection, project: str | None) -> tuple[int | str, int]:
    """What names the alerts of `project` (None: of every project) in their tag
    (`conditional.alerts_tag`): the project's id, or `*`, with its alerts counter. A
    project without a row has no alerts: every such answer is the empty page."""
    if project is None:  # projects are never deleted: the sum only rises
        return "*", int(connection.scalar(_ALL_ALERTS_VERSION) or 0)
    row = connection.execute(_PROJECT_ALERTS_VERSION, {"project": project}).first()
    return (row.id, row.alerts_version) if row is not None else (0, 0)


def _caller_alerts_version(
    connection: Connection, request: Request, principal: Principal
) -> tuple[str | None, tuple[int | str, int]]:
    """In the caller's hop (`deps.reads_with_caller`): the projects the page will cover,
    with `_alerts_version` of them."""
    scope = principal.project or request.query_params.get("project")
    return scope, _alerts_version(connection, scope)


def _own_alerts_version(request: Request, project: str | None) -> tuple[int | str, int]:
    with request.app.state.lookup_connections() as connection:
        return _alerts_version(connection, project)


async def unchanged_alerts(
    request: Request,
    principal: PrincipalDep,
    project: Annotated[
        str | None, Query(description="Only this project's alerts (a project token: its own).")
    ] = None,
) -> str | None:
    """The projects an alert list across runs covers (None: every project the caller may
    read), after the tag check (`conditional.check_tag`): its tag is the alerts counter of
    those projects (`conditional.alerts_tag`), read in the caller's hop, before the page's
    own session and in an earlier snapshot than the page's, so a tag never names an older
    page than its own; a kept page is answered before that session opens."""
    if project is not None:
        principal.check_project(project)
    scope = principal.project or project
    read = caller_read(request)
    if read is None or read[0] != scope:  # no `reads_with_caller` read it for this scope
        read = (scope, await run_in_threadpool(_own_alerts_version, request, scope))
    conditional.check_tag(request, conditional.alerts_tag(request, *read[1]))
    return scope


#: The projects of an alert list across runs, after its tag check (`unchanged_alerts`).
AlertsReadDep = Annotated[str | None, Depends(unchanged_alerts)]


@router.get("/alerts", responses=NOT_YOURS)
@reads_with_caller(_caller_alerts_version)
def list_alerts(
    scope: AlertsReadDep,
    session: SessionDep,
    status: StatusQuery = None,
    severity: SeverityQuery = None,
    rule: RuleQuery = None,
    limit: LimitQuery = DEFAULT_PAGE,
    offset: OffsetQuery = 0,
) -> AlertsPublic:
    """Alerts across every run the caller may read, newest first. Tagged by the alerts
    counter of the projects it covers (`unchanged_alerts`), and kept: a thousand viewers
    of a project's alerts cost one page per change of them, and a kept page no session."""
    conditions = _filters(status, severity, rule)
    return _page(session, conditions, limit, offset, project=scope)


@router.get("/alert-rules")
def alert_rules() -> AlertRulesPublic:
    """Every rule with its severity, scope, meaning, default settings and their meaning."""
    return AlertRulesPublic(
        rules=[
            AlertRulePublic(
                name=rule.name,
                severity=rule.severity,
                scope=rule.scope,
                description=rule.description,
                defaults=rule.settings().model_dump(),
                settings={
                    name: field.description or ""
                    for name, field in rule.settings.model_fields.items()
                },
            )
            for rule in RULES.values()
        ]
    )


def _checked(body: AlertConfigIn) -> dict[str, dict[str, Any]]:
    try:
        return validate_overrides(body.rules)
    except AlertConfigError as error:
        raise HTTPException(status_code=422, detail=str(error)) from None


def _existing_project(session: Session, principal: PrincipalDep, project: str) -> None:
    principal.check_project(project)
    if session.scalar(select(Project.id).where(Project.name == project)) is None:
        raise HTTPException(status_code=404, detail=f"project {project!r} not found")


def _config(session: Session, *, project: str, run_id: int | None) -> AlertConfigPublic:
    project_rules, run_rules = stored_overrides(session, project=project, run_id=run_id)
    scope = AlertConfig.run_id == run_id if run_id is not None else AlertConfig.project == project
    updated = session.scalar(select(AlertConfig.updated_at).where(scope))
    effective = effective_settings(
        file_rules(session), project, project_rules, run_rules if run_id is not None else None
    )
    return AlertConfigPublic(
        project=project,
        run_id=run_id,
        rules=run_rules if run_id is not None else project_rules,
        effective={name: settings.model_dump() for name, settings in effective.items()},
        updated_at=_seconds(updated),
    )


def _store(
    session: Session, rules: dict[str, Any], *, project: str | None, run_id: int | None
) -> None:
    """Upsert the scope's overrides (ON CONFLICT: two writers of one scope both succeed,
    the later wins)."""
    begin_write(session)
    key = "project" if project is not None else "run_id"
    statement = dialect_insert(session, AlertConfig).values(
        project=project, run_id=run_id, rules=rules, updated_at=utcnow()
    )
    session.execute(
        statement.on_conflict_do_update(
            index_elements=[key],
            set_={"rules": statement.excluded.rules, "updated_at": statement.excluded.updated_at},
        )
    )
    # The step series carries the rule lines these overrides move.
    run_version.bump_where(session, Run.project == project if project else Run.id == run_id)
    session.commit()


@router.get("/projects/{project}/alert-config", responses=PROJECT_ERRORS)
def get_project_config(
    project: str, session: SessionDep, principal: PrincipalDep
) -> AlertConfigPublic:
    """The project's threshold overrides and the settings its runs get from them."""
    _existing_project(session, principal, project)
    return _config(session, project=project, run_id=None)


@router.put("/projects/{project}/alert-config", responses=PROJECT_ERRORS)
def put_project_config(
    project: str, body: AlertConfigIn, session: SessionDep, principal: PrincipalDep
) -> AlertConfigPublic:
    """Replace the project's threshold overrides (422 names an unknown rule or setting)."""
    _existing_project(session, principal, project)
    rules = _checked(body)
    session.rollback()
    _store(session, rules, project=project, run_id=None)
    return _config(session, project=project, run_id=None)


def _run_project(session: Session, run_id: int) -> str:
    project = session.scalar(select(Run.project).where(Run.id == run_id))
    if project is None:  # deleted since the existence check
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return project


@router.get("/runs/{run_id}/alert-config", responses=RUN_ERRORS)
def get_run_config(run_id: RunIdDep, session: SessionDep) -> AlertConfigPublic:
    """The run's own overrides and its effective settings (run > project > file > defaults)."""
    return _config(session, project=_run_project(session, run_id), run_id=run_id)


@router.put("/runs/{run_id}/alert-config", responses=RUN_ERRORS)
def put_run_config(run_id: RunIdDep, body: AlertConfigIn, session: SessionDep) -> AlertConfigPublic:
    """Replace the run's threshold overrides; they apply from its next batch."""
    rules = _checked(body)
    project = _run_project(session, run_id)
    session.rollback()
    _store(session, rules, project=None, run_id=run_id)
    return _config(session, project=project, run_id=run_id)
