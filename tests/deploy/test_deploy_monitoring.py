"""`deploy/`: the Prometheus alerting rules pass `promtool check rules` and their own unit
tests (`promtool test rules`), the scrape config passes `promtool check config`, and the
Grafana dashboard has what Grafana requires and queries only series the collector serves."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ampwatch.server import run_metrics

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "ampwatch.json"
#: Every series name /metrics can serve (per-run families and the collector's own).
SERVED = {family.name for family in run_metrics.FAMILIES} | {
    "ampwatch_runs", "ampwatch_metrics_runs_omitted", "ampwatch_ingest_batches_total",
    "ampwatch_ingest_duplicate_batches_total", "ampwatch_ingest_steps_total",
    "ampwatch_ingest_layer_values_total", "ampwatch_ingest_rejected_total",
}  # fmt: skip


def _promtool(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool is not installed (Debian package prometheus: make test installs it)")
    return subprocess.run([tool, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          check=False)  # fmt: skip


def test_the_alerting_rules_pass_promtool_check_and_their_unit_tests() -> None:
    checked = _promtool("check", "rules", "ampwatch-rules.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 5 rules found" in checked.stdout
    tested = _promtool("test", "rules", "ampwatch-rules.test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_rule_tests_can_fail(tmp_path: Path) -> None:
    shutil.copy(PROMETHEUS / "ampwatch-rules.yml", tmp_path)
    tests = (PROMETHEUS / "ampwatch-rules.test.yml").read_text()
    wrong = tests.replace(
        'run_id: "7", rule: loss_scale_collapse', 'run_id: "8", rule: loss_scale_collapse'
    )
    assert wrong != tests
    (tmp_path / "wrong.test.yml").write_text(wrong)
    assert _promtool("test", "rules", "wrong.test.yml", cwd=tmp_path).returncode != 0


def test_the_scrape_config_passes_promtool(tmp_path: Path) -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["authorization"]["type"] == "Bearer"
    # As compose mounts them: the rules beside the config, the token as a secret file.
    rules = tmp_path / "ampwatch-rules.yml"
    shutil.copy(PROMETHEUS / "ampwatch-rules.yml", rules)
    token = tmp_path / "token"
    token.write_text("aw_00000000_secret\n")
    config["rule_files"] = [str(rules)]
    job["authorization"]["credentials_file"] = str(token)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    checked = _promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _names_in(expr: str) -> set[str]:
    return set(re.findall(r"\bampwatch_[a-z_]+", expr))


def test_the_rules_mirror_every_critical_collector_rule() -> None:
    from ampwatch.server.alerts.rules import RULES

    groups = yaml.safe_load((PROMETHEUS / "ampwatch-rules.yml").read_text())["groups"]
    rules = {rule["alert"]: rule for group in groups for rule in group["rules"]}
    critical = rules["AmpwatchRunCritical"]
    # One rule pages on every critical rule the collector fires, whatever its name (new
    # rules included): it must not filter on rule names.
    assert 'severity="critical"' in critical["expr"] and "rule=" not in critical["expr"]
    assert any(rule.severity == "critical" for rule in RULES.values())
    for rule in rules.values():
        assert _names_in(rule["expr"]) <= SERVED, rule["alert"]


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # rows
    return panels


def test_the_grafana_dashboard_has_what_grafana_requires() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", dashboard["uid"])
    assert dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = _panels(dashboard)
    assert len({p["id"] for p in panels}) == len(panels)
    titles = {p["title"] for p in panels}
    assert {"Runs", "Loss scale", "Skip rate", "Firing alerts"} <= titles
    for panel in panels:
        if panel["type"] == "row":
            continue
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"} and grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(set(refs)) == len(refs), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            names = _names_in(target["expr"])
            assert names and names <= SERVED, (panel["title"], names - SERVED)


def dashboard_queries() -> list[str]:
    """Every panel query with its variables filled in as Grafana would for "All"
    (the Prometheus integration test runs them against a real Prometheus)."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        target["expr"].replace("$project", ".*").replace("$run", ".*")
        .replace("$__rate_interval", "1m")
        for panel in _panels(dashboard) for target in panel.get("targets", [])
    ]  # fmt: skip
