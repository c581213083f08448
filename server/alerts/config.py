"""Rule thresholds: defaults < the collector's TOML file < a project's < a run's overrides.

The file (`alerts_file` setting, env `AMPWATCH_ALERTS_FILE`) has a global section and
per-project sections::

    [rules.skip_rate]
    max_fraction = 0.1

    [projects.vision.rules.silent_underflow]
    min_increase = 0.5

Project and run overrides are `alert_configs` rows, set through the API. Every layer is
validated against the rule's settings model when it is written (file: at startup), so
merging layers can never produce an invalid setting.

>>> effective_settings(FileRules(), "vision")["skip_rate"].max_fraction
0.05
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy import or_, select
from sqlalchemy.orm import Session, sessionmaker

from ampwatch.server.alerts.rule_settings import RuleSettings
from ampwatch.server.alerts.rules import RULES
from ampwatch.server.models import AlertConfig, Run

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the same parser, from PyPI (pyproject: server extra)
    import tomli as tomllib

#: `Session.info` key under which the collector puts its parsed alerts file
#: (`ampwatch.server.api.alerts.mount`); sessions without it read `AMPWATCH_ALERTS_FILE`.
FILE_RULES_KEY = "ampwatch.alert_file_rules"

Overrides = dict[str, dict[str, Any]]


class AlertConfigError(ValueError):
    """Overrides that name an unknown rule or setting, or give a value of the wrong type."""


@dataclass(frozen=True)
class FileRules:
    """The alerts file, parsed and validated: global overrides and per-project ones."""

    rules: Overrides = field(default_factory=dict)
    projects: dict[str, Overrides] = field(default_factory=dict)


def validate_overrides(rules: Any, *, where: str = "rules") -> Overrides:
    """`rules` ({rule: {setting: value}}) checked against every rule's settings model.

    Raises AlertConfigError naming the rule, the setting and what was wrong.

    >>> validate_overrides({"skip_rate": {"max_fraction": 0.2}})
    {'skip_rate': {'max_fraction': 0.2}}
    """
    if not isinstance(rules, Mapping):
        raise AlertConfigError(f"{where} must map rule names to their settings")
    checked: Overrides = {}
    for rule, overrides in rules.items():
        if rule not in RULES:
            raise AlertConfigError(
                f"{where}: unknown rule {rule!r}; known rules: {', '.join(RULES)}"
            )
        if not isinstance(overrides, Mapping):
            raise AlertConfigError(f"{where}.{rule} must map setting names to values")
        model = RULES[rule].settings
        try:
            model.model_validate(dict(overrides))
        except ValidationError as error:
            problems = []
            for problem in error.errors():
                name = ".".join(str(part) for part in problem["loc"]) or rule
                if problem["type"] == "extra_forbidden":
                    known = ", ".join(model.model_fields)
                    problems.append(f"unknown setting {name!r} (settings: {known})")
                else:
                    problems.append(f"{name}: {problem['msg']} (got {problem['input']!r})")
            raise AlertConfigError(f"{where}.{rule}: {'; '.join(problems)}") from None
        checked[rule] = dict(overrides)
    return checked


def load_file(path: str | Path) -> FileRules:
    """Parse and validate the alerts file at `path` (raises AlertConfigError)."""
    try:
        document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise AlertConfigError(f"cannot read alerts file {path}: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise AlertConfigError(f"alerts file {path} is not valid TOML: {error}") from None
    unknown = sorted(set(document) - {"rules", "projects"})
    if unknown:
        raise AlertConfigError(
            f"alerts file {path}: unknown section(s) {unknown}; expected [rules.<rule>] "
            "and [projects.<project>.rules.<rule>]"
        )
    rules = validate_overrides(document.get("rules", {}), where=f"{path}: rules")
    projects: dict[str, Overrides] = {}
    for project, section in dict(document.get("projects", {})).items():
        if not isinstance(section, Mapping) or set(section) - {"rules"}:
            raise AlertConfigError(
                f"alerts file {path}: projects.{project} may only hold a 'rules' table"
            )
        projects[project] = validate_overrides(
            section.get("rules", {}), where=f"{path}: projects.{project}.rules"
        )
    return FileRules(rules=rules, projects=projects)


@functools.lru_cache(maxsize=4)
def _file_from_env(path: str) -> FileRules:
    return load_file(path) if path else FileRules()


def with_file_rules(sessions: sessionmaker[Session], path: Path | None) -> sessionmaker[Session]:
    """`sessions`, configured with the alerts file at `path` (parsed and validated here:
    a bad file fails the collector's start), which `file_rules` gives their sessions: the
    collector's own and its ingest process's."""
    rules = load_file(path) if path is not None else FileRules()
    sessions.configure(info={**sessions.kw.get("info", {}), FILE_RULES_KEY: rules})
    return sessions


def file_rules(session: Session) -> FileRules:
    """The alerts file this session's collector runs with (see `FILE_RULES_KEY`)."""
    configured = session.info.get(FILE_RULES_KEY)
    if isinstance(configured, FileRules):
        return configured
    from ampwatch.server.settings import Settings  # the collector's one reader of AMPWATCH_*

    path = Settings().alerts_file
    return _file_from_env("" if path is None else str(path))


def effective_settings(
    file: FileRules,
    project: str,
    project_overrides: Overrides | None = None,
    run_overrides: Overrides | None = None,
) -> dict[str, RuleSettings]:
    """Every rule's settings after applying, in order, the file's global and project
    sections, the project's overrides and the run's."""
    layers = (file.rules, file.projects.get(project, {}), project_overrides or {},
              run_overrides or {})  # fmt: skip
    effective: dict[str, RuleSettings] = {}
    for name, rule in RULES.items():
        merged: dict[str, Any] = {}
        for layer in layers:
            merged.update(layer.get(name, {}))
        effective[name] = rule.settings.model_validate(merged) if merged else _default(name)
    return effective


@functools.cache
def _default(rule: str) -> RuleSettings:
    return RULES[rule].settings()


def stored_overrides(
    session: Session, *, project: str, run_id: int | None
) -> tuple[Overrides, Overrides]:
    """(project overrides, run overrides) from `alert_configs`, in one query."""
    scope = AlertConfig.project == project
    if run_id is not None:
        scope = or_(scope, AlertConfig.run_id == run_id)
    project_rules: Overrides = {}
    run_rules: Overrides = {}
    for config_project, rules in session.execute(
        select(AlertConfig.project, AlertConfig.rules).where(scope)
    ):
        if config_project is not None:
            project_rules = dict(rules or {})
        else:
            run_rules = dict(rules or {})
    return project_rules, run_rules


def run_settings(session: Session, *, project: str, run_id: int) -> dict[str, RuleSettings]:
    """The effective settings of run `run_id` of `project`."""
    project_rules, run_rules = stored_overrides(session, project=project, run_id=run_id)
    return effective_settings(file_rules(session), project, project_rules, run_rules)


def settings_of_run(session: Session, run_id: int) -> dict[str, RuleSettings] | None:
    """`run_settings` of run `run_id` looked up by id (None: no such run): what the rule
    engine judges it by, and so what the advisor and the charts must use too."""
    project = session.scalar(select(Run.project).where(Run.id == run_id))
    return None if project is None else run_settings(session, project=project, run_id=run_id)
