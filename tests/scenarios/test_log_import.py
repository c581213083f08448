"""`ampwatch import` into a real collector over HTTP: an imported log fires the same
alerts, at the same steps, as the same series recorded through `handle.record()`;
importing twice stores it once; a line that does not read is skipped, counted and stored
as a finding; a healthy DeepSpeed-Chat log raises no critical alert."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from real_logs import CORPUS, load_excerpt, replay
from scenario_catalog import find_run

from ampwatch.agent.logs import Target, import_logs
from ampwatch.server.cli import main

FORMATS = Path(__file__).resolve().parents[1] / "data" / "log_formats"


def _alerts(api: httpx.Client, client_run_id: str) -> list[tuple[Any, ...]]:
    run = find_run(api, client_run_id)
    alerts = api.get(f"/api/v1/runs/{run['id']}/alerts", params={"limit": 500}).json()["alerts"]
    return sorted((a["rule"], a["layer"], a["severity"], a["status"], a["started_step"],
                   a["fired_step"], a["resolved_step"]) for a in alerts)  # fmt: skip


def _without_header(path: Path, tmp_path: Path) -> Path:
    """The excerpt as a user's log file: its provenance header removed."""
    lines = [t for t in path.read_text().splitlines(keepends=True)
             if not t.startswith("# ") or t.startswith("# scaler:")]  # fmt: skip
    out = tmp_path / path.name
    out.write_text("".join(lines))
    return out


@pytest.mark.parametrize(
    "name",
    ["tr8b-104B-exp07-resume-burst", "fairseq-512-min-scale", "transformers-14531-floor-stall",
     "chinese-llama-534-min-scale", "tr8-104B-exp12-divergence", "apex-834-scale-to-zero"],
)  # fmt: skip
def test_import_fires_the_alerts_that_record_fires(name: str, live_collector, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The same alerts as `handle.record()` on the same series; where the excerpt starts
    mid-run (its run_start says the scaler has a history, which `record()` cannot say),
    every rule `record()` fires fires too, and the first alert comes no later."""
    excerpt = load_excerpt(CORPUS / f"{name}.log")
    # The same series through handle.record(): without the scaler's floor, which the
    # corpus knows from its provenance header and the log itself does not print.
    recorded = replay(excerpt, live_collector.url, project="recorded", report_floor=False)
    log = _without_header(CORPUS / f"{name}.log", tmp_path)
    target = Target(live_collector.url, project="imported")
    report = import_logs([str(log)], target, fmt="auto", log=lambda _: None)
    assert report.upload is not None and report.upload.complete
    with httpx.Client(base_url=live_collector.url, timeout=30) as api:
        by_record = _alerts(api, recorded)
        by_import = _alerts(api, report.runs[0].client_run_id)
        run = find_run(api, report.runs[0].client_run_id)
        events = api.get(f"/api/v1/runs/{run['id']}/events").json()
    assert by_record, f"{name}: the incident fires nothing; the comparison would be empty"
    starts = [e["data"] for e in events["events"] if e["kind"] == "run_start"]
    if not any(d.get("scaler_calibrated") for d in starts):
        assert by_import == by_record
        return
    assert {a[0] for a in by_record} <= {a[0] for a in by_import}
    assert min(a[5] for a in by_import) <= min(a[5] for a in by_record)


def test_two_engines_import_as_two_runs_with_their_own_alerts(live_collector) -> None:  # type: ignore[no-untyped-def]
    report = import_logs([str(FORMATS / "deepspeed-chat-rlhf-actor-critic.log")],
                         Target(live_collector.url, name="rlhf"), log=lambda _: None)  # fmt: skip
    assert sorted(r.name for r in report.runs) == ["rlhf-actor", "rlhf-critic"]
    with httpx.Client(base_url=live_collector.url, timeout=30) as api:
        for run in report.runs:
            stored = find_run(api, run.client_run_id)
            series = api.get(f"/api/v1/runs/{stored['id']}/steps").json()
            skipped = [s for s, hit in zip(series["step"], series["skipped"]) if hit]
            assert skipped == ([0, 1, 2, 5, 10] if run.name == "rlhf-actor" else [0, 1, 2])


def _counts(database_url: str) -> tuple[int, int, int]:
    engine = sa.create_engine(database_url)
    with engine.connect() as db:
        steps = db.execute(sa.text("SELECT count(*) FROM steps")).scalar_one()
        events = db.execute(sa.text("SELECT count(*) FROM events")).scalar_one()
        runs = db.execute(sa.text("SELECT count(*) FROM runs")).scalar_one()
    engine.dispose()
    return steps, events, runs


def test_importing_twice_stores_once(live_collector, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    log = _without_header(CORPUS / "deepspeed-chat-sft-opt1.3b.log", tmp_path)
    assert main(["import", str(log), "--url", live_collector.url, "--run", "sft"]) == 0
    first = capsys.readouterr().out
    assert "format deepspeed (" in first and "7360 steps" in first
    once = _counts(live_collector.database_url)
    assert once[0] == 7360 and once[2] == 1
    assert main(["import", str(log), "--url", live_collector.url, "--run", "sft"]) == 0
    second = capsys.readouterr().out
    assert "0 batches stored" in second and "already there" in second
    assert _counts(live_collector.database_url) == once


def test_a_bad_line_is_skipped_counted_and_stored_as_a_finding(live_collector, tmp_path,
                                                              capsys) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """One unreadable number and a last line cut after `learning` (a killed job) refused
    the whole file before issue 31: now the other steps are stored, the two lines counted,
    printed and stored with the run (a `finding` event, code log_lines_unread)."""
    good = (CORPUS / "tr8-104B-exp2-glitch.log").read_text().splitlines()
    lines = [t for t in good if not t.startswith("# ")]
    lines[3] = lines[3].replace("lm loss: 9.121927E+00", "lm loss: 9.12.1927E+00")
    log = tmp_path / "broken.log"
    log.write_text("\n".join(lines) + "\n" + lines[4].replace(" 6940/", " 6950/").split("learning")[0]
                   + "learning")  # fmt: skip
    assert main(["import", str(log), "--url", live_collector.url]) == 0
    out = capsys.readouterr().out
    assert "2 lines not read: 1 unreadable value (line 4); 1 cut (line 6)" in out
    steps, _, _ = _counts(live_collector.database_url)
    assert steps == 4
    engine = sa.create_engine(live_collector.database_url)
    with engine.connect() as db:
        rows = db.execute(sa.text("SELECT data FROM events WHERE kind = 'finding'")).all()
    engine.dispose()
    data = [r[0] if isinstance(r[0], dict) else json.loads(r[0]) for r in rows]
    (unread,) = [d for d in data if d["code"] == "log_lines_unread"]
    assert unread["count"] == 2 and unread["lines"] == {"unreadable value": [4], "cut": [6]}


def test_a_healthy_deepspeed_chat_log_raises_no_critical(live_collector, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The OPT-1.3B SFT log (healthy) without the corpus's `# scaler:` line, as its users
    have it: the old importer replayed DeepSpeed's default window, drifted to 1.0 and raised
    55 critical loss_scale_collapse alerts; the printed scales raise none."""
    text = (CORPUS / "deepspeed-chat-sft-opt1.3b.log").read_text().splitlines(keepends=True)
    log = tmp_path / "sft.log"
    log.write_text("".join(t for t in text if not t.startswith("#")))
    report = import_logs([str(log)], Target(live_collector.url), log=lambda _: None)
    with httpx.Client(base_url=live_collector.url, timeout=30) as api:
        alerts = _alerts(api, report.runs[0].client_run_id)
    assert [a for a in alerts if a[2] == "critical"] == []


def test_an_overflow_storm_from_mid_run_is_not_warm_up(live_collector, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """apex prints no step: an excerpt of 12 overflows from a run many epochs in (its first
    attempted scale 16384, not apex's initial 65536) was numbered from 1 and judged as
    warm-up calibration, so the storm passed unflagged. The run_start now says the scaler
    has a history (`wire.SCALER_CALIBRATED`): 10 skips in a row fire. A run that starts at
    apex's initial scale is still warm-up. (Lines in apex's format, "Gradient overflow.
    Skipping step, loss scaler 0 reducing loss scale to X".)"""
    line = "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to {}\n"
    mid = tmp_path / "mid.log"
    mid.write_text("".join(line.format(2.0 ** (13 - i)) for i in range(12)))
    fresh = tmp_path / "fresh.log"
    fresh.write_text("".join(line.format(2.0 ** (15 - i)) for i in range(12)))
    with httpx.Client(base_url=live_collector.url, timeout=30) as api:
        fired = {}
        for log in (mid, fresh):
            report = import_logs([str(log)], Target(live_collector.url), log=lambda _: None)
            fired[log.stem] = {a[0] for a in _alerts(api, report.runs[0].client_run_id)}
    assert "loss_scale_collapse" in fired["mid"]
    assert fired["fresh"] == set()
