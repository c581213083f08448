"""Projects, API tokens and who may do what.

A token is `aw_<prefix>_<secret>`: `prefix` (8 hex digits) is public and finds the row,
`secret` is 32 random bytes. Only the SHA-256 of the whole token is stored. A slow KDF
(bcrypt, argon2) protects low-entropy passwords from guessing after a leak; a 256-bit
random secret cannot be guessed, so a fast hash is as safe, and it keeps the per-batch
check on the ingest path at microseconds instead of ~100 ms.

Rules (`resolve_principal`): a token of project P reads and writes only P's runs; an admin
token (`AMPWATCH_ADMIN_TOKEN`, or a stored token without project) may do everything.
A stored token also has a scope (`GRANTS`): `write` (the default) reads and writes,
`read` only reads (what a dashboard needs), `metrics` only scrapes `/metrics` (what a
Prometheus needs), each within its project, or every project when made without one.
What a request needs follows from its route (`required_access`): what the route declares
in its OpenAPI operation (`ACCESS_EXTRA`; `/metrics` declares `metrics`), else `read` for
a GET and `write` for every other method. In
`auth="auto"` mode the collector trusts every caller while no credential exists at all
and it listens on loopback only, as PostgreSQL trusts its local socket: only processes on
this machine can connect. Every decision reads the database, never process memory, so
a token created or revoked by the CLI takes effect in every worker at once.

>>> issued = create_token(session, project="vision")  # doctest: +SKIP
>>> issued.token  # shown once; the database keeps only its hash  # doctest: +SKIP
'aw_1f2e3d4c_...'
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, bindparam, exists, select
from sqlalchemy.orm import Session

from ampwatch.server.db import begin_write, dialect_insert
from ampwatch.server.models import Project, Token, TokenScope, utcnow
from ampwatch.server.settings import Settings

logger = logging.getLogger(__name__)

TOKEN_SCHEME = "aw"
DEFAULT_PROJECT = "default"
_LOOPBACK_NAMES = frozenset({"localhost"})
DEFAULT_SCOPE: TokenScope = "write"
#: The OpenAPI extension in which a route declares the access it needs (`openapi_extra`),
#: where its method does not say it: `{ACCESS_EXTRA: "metrics"}` on the scrape target.
ACCESS_EXTRA = "x-ampwatch-access"

#: What each token scope grants: kinds of access, each a route's `required_access`.
GRANTS: dict[str, frozenset[str]] = {
    "write": frozenset({"write", "read", "metrics"}),
    "read": frozenset({"read", "metrics"}),
    "metrics": frozenset({"metrics"}),
}
_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class AuthError(Exception):
    """A request the caller may not make; `status` is 401 (who are you) or 403 (not yours)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def required_access(method: str, declared: str | None = None) -> str:
    """The access a request needs: what its route `declared` (`ACCESS_EXTRA`), else
    `read` for a GET and `write` for everything else (a GET never changes anything here).

    >>> required_access("POST"), required_access("GET"), required_access("GET", "metrics")
    ('write', 'read', 'metrics')
    """
    if declared is not None:
        return declared
    return "read" if method.upper() in _READ_METHODS else "write"


@dataclass(frozen=True)
class Principal:
    """Who is calling: `project` None means every project (admin token or local trust);
    `scope` what it may do there (`GRANTS`)."""

    project: str | None
    scope: TokenScope = DEFAULT_SCOPE

    @property
    def is_admin(self) -> bool:
        """Every project (what it may do there is `scope`'s, checked at the door)."""
        return self.project is None

    def check_access(self, access: str) -> None:
        """Raise 403 unless this caller's scope grants `access` (`required_access`)."""
        if access not in GRANTS[self.scope]:
            raise AuthError(
                403,
                f"this is a {self.scope!r} token and this request needs {access!r} access; "
                f"use a token created with --scope {access}"
                + (" (or write)" if access == "read" else ""),
            )

    def check_project(self, project: str) -> None:
        """Raise 403 unless this caller may touch `project`'s runs.

        The message names only the caller's own project: a tenant probing run ids or
        project names must not learn which other projects exist.
        """
        if self.project is not None and project != self.project:
            raise AuthError(
                403,
                f"this token belongs to project {self.project!r} and cannot access another "
                "project's data; use a token of that project",
            )


@dataclass(frozen=True)
class IssuedToken:
    """A freshly created token: `token` is the only time the secret is ever visible."""

    token: str
    prefix: str
    project: str | None
    name: str
    scope: TokenScope = DEFAULT_SCOPE


@dataclass(frozen=True)
class TokenInfo:
    prefix: str
    project: str | None
    name: str
    created_at: datetime
    revoked_at: datetime | None
    scope: TokenScope = DEFAULT_SCOPE


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def ensure_project(session: Session, name: str) -> int:
    """The id of the project named `name`, created if new (the caller commits).

    INSERT ... ON CONFLICT DO NOTHING: two workers creating the same project at once
    both succeed instead of one failing on the unique name.
    """
    project_id = session.scalar(select(Project.id).where(Project.name == name))
    if project_id is None:
        insert = dialect_insert(session, Project).values(name=name, created_at=utcnow())
        session.execute(insert.on_conflict_do_nothing(index_elements=["name"]))
        project_id = session.scalars(select(Project.id).where(Project.name == name)).one()
    return int(project_id)


def create_token(
    session: Session, *, project: str | None, name: str = "", scope: TokenScope = DEFAULT_SCOPE
) -> IssuedToken:
    """Store a new token for `project` (None: every project) with `scope` and return it,
    once. A `metrics` token without project scrapes every project's series."""
    if scope not in GRANTS:
        raise ValueError(f"unknown token scope {scope!r}; expected one of {list(GRANTS)}")
    prefix = secrets.token_hex(4)
    token = f"{TOKEN_SCHEME}_{prefix}_{secrets.token_urlsafe(32)}"
    begin_write(session)
    project_id = ensure_project(session, project) if project is not None else None
    label = name or f"{scope} token for {project or 'every project'}"
    session.add(
        Token(
            project_id=project_id,
            prefix=prefix,
            secret_hash=hash_token(token),
            name=label,
            created_at=utcnow(),
            scope=scope,
        )
    )
    session.commit()
    return IssuedToken(token=token, prefix=prefix, project=project, name=label, scope=scope)


def list_tokens(session: Session) -> list[TokenInfo]:
    """Every token ever created, oldest first (secrets are not stored, so never shown)."""
    rows = session.execute(
        select(Token, Project.name)
        .outerjoin(Project, Project.id == Token.project_id)
        .order_by(Token.id)
    )
    return [
        TokenInfo(t.prefix, project, t.name, t.created_at, t.revoked_at, t.scope)
        for t, project in rows
    ]


def revoke_token(session: Session, prefix: str) -> bool:
    """Revoke the token with public `prefix`; False when there is no such token."""
    token = session.scalars(select(Token).where(Token.prefix == prefix)).one_or_none()
    if token is None:
        return False
    if token.revoked_at is None:
        token.revoked_at = utcnow()
        session.commit()
    return True


def is_loopback(host: str) -> bool:
    """Whether binding `host` accepts connections from this machine only."""
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def any_credential(session: Session | Connection, settings: Settings) -> bool:
    """Whether a token exists (revoked ones count: revoking must never reopen access)."""
    return settings.admin_token is not None or bool(session.scalar(select(exists(Token.id))))


def trusts_everyone(
    session: Session | Connection, settings: Settings, peer: str | None = None
) -> bool:
    """Whether requests need no token: the explicit override, or the local-trust default.

    `peer` is the caller's address as the connection shows it: local trust needs a
    loopback caller too, since the configured host is not always the bound one
    (`uvicorn --factory ... --host 0.0.0.0` keeps the default 127.0.0.1 setting).
    """
    if settings.auth == "open":
        return True
    if settings.auth == "token" or not is_loopback(settings.host):
        return False
    if peer is not None and not is_loopback(peer):
        return False
    return not any_credential(session, settings)


def check_exposure(session: Session, settings: Settings) -> None:
    """Refuse to serve the network with no way to authenticate (raises RuntimeError)."""
    if is_loopback(settings.host):
        return
    if settings.auth == "open":
        logger.warning(
            "AMPWATCH_AUTH=open on %s: tokens are not checked; anyone who can reach this "
            "collector reads and writes every run",
            settings.host,
        )
    if settings.auth != "auto":
        return
    if not any_credential(session, settings):
        raise RuntimeError(
            f"refusing to listen on {settings.host!r} with no token: anyone who can reach it "
            "could read and write every run. Create a token (ampwatch token create --project "
            "P), set AMPWATCH_ADMIN_TOKEN, bind 127.0.0.1, or set AMPWATCH_AUTH=open if a "
            "proxy in front of the collector authenticates callers."
        )


#: A presented token's hash, revocation, scope and project, by its prefix: built once (every
#: request reads it), as columns rather than a Token object: the lookup's CPU on SQLite
#: 118 -> 84 us, on PostgreSQL 256 -> 200 us: no ORM object per request, and table columns
#: (the ORM's columns, `Token.scope`, took the ORM's path: 110 us on SQLite).
_TOKENS, _PROJECTS = Token.__table__.c, Project.__table__.c
_TOKEN_BY_PREFIX = (
    select(_TOKENS.secret_hash, _TOKENS.revoked_at.is_not(None), _TOKENS.scope, _PROJECTS.name)
    .select_from(Token.__table__.outerjoin(Project.__table__, _PROJECTS.id == _TOKENS.project_id))
    .where(_TOKENS.prefix == bindparam("prefix"))
)


def resolve_principal(
    session: Session | Connection,
    settings: Settings,
    authorization: str | None,
    *,
    access: str = "write",
    peer: str | None = None,
) -> Principal:
    """Who sent a request with this `Authorization` header, needing `access`
    (`required_access`) from `peer` (the connection's address); raises AuthError 401, or
    403 when the token's scope lacks it.

    A presented token is always checked, even where no token is required: a wrong token
    is a misconfiguration the caller should hear about.
    """
    if not authorization:
        if trusts_everyone(session, settings, peer):
            return Principal(project=None)
        raise AuthError(401, "this collector needs a token: send 'Authorization: Bearer <token>'")
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthError(401, "malformed Authorization header; expected 'Bearer <token>'")
    admin = settings.admin_token
    if admin is not None and hmac.compare_digest(token.encode(), admin.get_secret_value().encode()):
        return Principal(project=None)
    scheme, _, rest = token.partition("_")
    prefix = rest.partition("_")[0]
    row = None
    if scheme == TOKEN_SCHEME and prefix:
        row = session.execute(_TOKEN_BY_PREFIX, {"prefix": prefix}).one_or_none()
    if row is None or not hmac.compare_digest(row[0], hash_token(token)):
        raise AuthError(401, "unknown token; create one with: ampwatch token create --project P")
    _, revoked, scope, project = row
    if revoked:
        raise AuthError(401, f"token {prefix} was revoked; create a new one")
    principal = Principal(project=project, scope=scope)
    principal.check_access(access)
    return principal


def project_for_new_data(principal: Principal, named: str | None) -> str:
    """The project a write (a run's creation or a batch) goes to (raises AuthError 403).

    `named` is the project the request names, None when it names none: then a project
    token's own project applies, else `default`. A run is keyed by (project,
    client_run_id), so the write finds or creates its run inside its own project only:
    two tenants that pick the same client run id (from a job name, say) get two runs,
    and no tenant can squat or reach another's. A project named for the first time is
    created with the run, in the write's transaction (`ensure_project`), so a refused
    write leaves no project behind.
    """
    project = named if named is not None else principal.project or DEFAULT_PROJECT
    principal.check_project(project)
    return project
