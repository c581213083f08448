"""The restart advisor on a crafted run: real batches ingested over HTTP, alerts inserted
as the alert engine would leave them, verdicts read from the API and the CLI."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import delete, event
from wire_batches import make_batch, step_record

from ampwatch.agent.wire import INGEST_PATH, EventRecord
from ampwatch.server.advisor import restart_candidates
from ampwatch.server.cli import main
from ampwatch.server.db import make_engine, make_sessionmaker
from ampwatch.server.incident import AdvisorConfig, AlertSpan, incident_onset, margin_for
from ampwatch.server.models import Alert, utcnow

#: For tests whose subject does not depend on the database (HTTP, CLI, arithmetic).
SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
T0 = 1_700_000_000.0
STEPS = 300
CHECKPOINTS = (50, 100, 120, 140, 160, 200, 250)


def loss_scale_at(step: int) -> float:
    """65536, one ordinary overflow at step 118 (32768 from 119), then a collapse: a
    halving per step from 165 down to the 0.25 floor."""
    scale = 65536.0 if step <= 118 else 32768.0
    if step > 165:
        scale = max(0.25, scale / 2 ** (step - 165))
    return scale


def act_norm_at(step: int) -> float:
    """About 10 with a little deterministic noise, spiking from step 150 (OPT's signature)."""
    norm = 10.0 + 0.1 * ((step * 7) % 5 - 2)
    return norm + 1.5 * (step - 150) if step >= 150 else norm


def checkpoint(step: int, path: str) -> EventRecord:
    return {"kind": "checkpoint", "step": step, "time": T0 + step, "data": {"path": path}}


def crafted_batch(client_run_id: str = "crash-run", name: str = "gpt-crash") -> dict[str, Any]:
    steps = [
        step_record(
            step,
            loss=2.0,
            loss_scale=loss_scale_at(step),
            skipped=loss_scale_at(step + 1) < loss_scale_at(step),
            act_norm_mean=act_norm_at(step),
            act_norm_max=act_norm_at(step) * 1.5,
        )
        for step in range(STEPS)
    ]
    events = [checkpoint(step, f"/ckpt/{step}.pt") for step in CHECKPOINTS]
    batch = make_batch(0, client_run_id=client_run_id, steps=steps, events=events)
    batch["run"]["name"] = name
    return dict(batch)


def alert(
    rule: str, severity: str, started: int, fired: int | None, resolved: int | None, layer: str = ""
) -> Alert:
    status = "resolved" if resolved is not None else "firing" if fired is not None else "pending"
    return Alert(
        rule=rule,
        layer=layer,
        severity=severity,
        status=status,
        started_step=started,
        fired_step=fired,
        resolved_step=resolved,
        started_at=utcnow(),
        message=f"{rule} test",
    )


def set_alerts(database_url: str, run_id: int, alerts: list[Alert]) -> None:
    """Replace whatever the alert engine made of the crafted run with these alerts."""
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            session.execute(delete(Alert).where(Alert.run_id == run_id))
            for row in alerts:
                row.run_id = run_id
                session.add(row)
            session.commit()
    finally:
        engine.dispose()


@pytest.fixture
def crash_run(collector: Any, client: httpx.Client) -> Iterator[int]:
    response = client.post(INGEST_PATH, json=crafted_batch())
    assert response.status_code == 200, response.text
    run_id = int(response.json()["run_id"])
    set_alerts(
        collector.database_url,
        run_id,
        [
            alert("activation_norm_spike", "warning", 152, 160, None),
            alert("skip_rate", "warning", 166, 170, None),
            alert("loss_scale_collapse", "critical", 175, 178, None),
            # A warning long resolved before the incident is not part of it.
            alert("skip_rate", "warning", 10, 12, 20),
            alert("no_data", "warning", 5, 6, 7),
        ],
    )
    yield run_id


def by_step(answer: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {c["step"]: c for c in answer["candidates"]}


def test_verdicts_on_a_crafted_collapse(client: httpx.Client, crash_run: int) -> None:
    answer = client.get(f"/api/v1/runs/{crash_run}/restart-candidates").json()
    assert answer["run_id"] == crash_run
    # The onset is the first precursor (the spike), not the collapse that reached critical.
    assert (answer["onset_step"], answer["onset_rule"]) == (152, "activation_norm_spike")
    assert answer["margin_steps"] == 20  # 2% of 300 steps is 6: the 20-step floor holds
    assert answer["recommended"] == {"step": 100, "path": "/ckpt/100.pt", "time": T0 + 100}
    assert [c["step"] for c in answer["candidates"]] == [100, 50, 250, 200, 160, 140, 120]
    c = by_step(answer)
    assert {s: c[s]["verdict"] for s in CHECKPOINTS} == {
        50: "healthy",
        100: "recommended",
        120: "rejected",
        140: "rejected",
        160: "rejected",
        200: "rejected",
        250: "rejected",
    }
    assert c[100]["loss_scale"] == 65536.0
    assert c[100]["act_norm"] == pytest.approx(act_norm_at(100))
    assert c[100]["reasons"] == [
        (
            f"latest healthy checkpoint: scale 65536, act norm {act_norm_at(100):.3g} within "
            "baseline 10±2, 52 steps before onset at step 152 (activation_norm_spike)"
        )
    ]
    assert c[50]["reasons"][0].startswith(f"healthy: scale 65536, act norm {act_norm_at(50):.3g}")
    assert c[50]["reasons"][1] == "a later healthy checkpoint (step 100) is recommended"
    assert c[120]["reasons"] == [
        (
            "loss scale mid-fall: 65536 -> 32768 between steps 118 and 119 (window: 20 steps "
            "up to the checkpoint and its own step)"
        )
    ]
    assert c[140]["reasons"] == [
        (
            "only 12 steps before incident onset at step 152 (activation_norm_spike); "
            "the margin is 20 steps"
        )
    ]
    assert c[160]["reasons"][0] == (
        f"act norm {act_norm_at(160):.3g} above baseline 10±2 (limit 12)"
    )
    assert "after incident onset at step 152 (activation_norm_spike)" in c[160]["reasons"]
    assert c[200]["loss_scale"] == 0.25
    assert c[200]["reasons"] == [
        "loss scale 0.25 < 1",
        (
            "loss scale mid-fall: 0.5 -> 0.25 between steps 181 and 182 (window: 20 steps up "
            "to the checkpoint and its own step)"
        ),
        f"act norm {act_norm_at(200):.3g} above baseline 10.1±2 (limit 12.1)",
        "critical alert loss_scale_collapse firing at step 200 (fired at step 178)",
        "after incident onset at step 152 (activation_norm_spike)",
    ]


@SQLITE_ONLY
def test_margin_and_scale_overrides(client: httpx.Client, crash_run: int) -> None:
    url = f"/api/v1/runs/{crash_run}/restart-candidates"
    answer = client.get(url, params={"margin_steps": 5}).json()
    assert answer["margin_steps"] == 5
    assert answer["recommended"]["step"] == 140  # 12 steps before the onset now suffice
    answer = client.get(url, params={"healthy_loss_scale": 100000}).json()
    assert answer["recommended"] is None
    assert "loss scale 65536 < 100000" in by_step(answer)[100]["reasons"]
    # The old name is still accepted (deprecated); the new one wins when both are given.
    old = client.get(url, params={"min_loss_scale": 100000}).json()
    assert old["recommended"] is None
    both = client.get(url, params={"min_loss_scale": 100000, "healthy_loss_scale": 1}).json()
    assert both["recommended"]["step"] == 100
    assert client.get(url, params={"healthy_loss_scale": 0}).status_code == 422
    assert client.get(url, params={"margin_steps": -1}).status_code == 422
    assert client.get("/api/v1/runs/999999/restart-candidates").status_code == 404


def test_no_incident_recommends_the_latest_healthy(
    collector: Any, client: httpx.Client, crash_run: int
) -> None:
    set_alerts(collector.database_url, crash_run, [])
    answer = client.get(f"/api/v1/runs/{crash_run}/restart-candidates").json()
    assert (answer["onset_step"], answer["onset_rule"]) == (None, None)
    # Without alerts the collapse itself still disqualifies 160..250, and 120 is mid-fall.
    assert answer["recommended"]["step"] == 140
    assert "no incident reached critical" in by_step(answer)[140]["reasons"][0]


def test_a_resolved_critical_only_rejects_while_it_fired(
    collector: Any, client: httpx.Client, crash_run: int
) -> None:
    set_alerts(
        collector.database_url,
        crash_run,
        [alert("silent_underflow", "critical", 40, 45, 60, layer="blocks.0.fc.weight")],
    )
    answer = client.get(f"/api/v1/runs/{crash_run}/restart-candidates").json()
    assert (answer["onset_step"], answer["onset_rule"]) == (40, "silent_underflow")
    c = by_step(answer)
    assert c[50]["reasons"] == [
        (
            "critical alert silent_underflow on blocks.0.fc.weight firing at step 50 "
            "(fired at step 45)"
        ),
        "after incident onset at step 40 (silent_underflow)",
    ]
    assert answer["recommended"] is None


@SQLITE_ONLY
def test_long_run_baseline_comes_from_rollups(client: httpx.Client) -> None:
    """1,000 steady steps: the act-norm baseline of a late checkpoint is read from the
    64-step rollups (min and max per rollup), not from the raw steps."""
    steps = [
        step_record(step, loss=1.0, loss_scale=65536.0, act_norm_mean=act_norm_at(step % 100))
        for step in range(1000)
    ]
    events = [checkpoint(step, f"/c/{step}") for step in (500, 900, 990)]
    batch = make_batch(0, client_run_id="long", steps=steps, events=events)
    response = client.post(INGEST_PATH, json=dict(batch))
    run_id = response.json()["run_id"]
    answer = client.get(f"/api/v1/runs/{run_id}/restart-candidates").json()
    assert answer["margin_steps"] == 20
    if answer["onset_step"] is None:  # the alert engine may have seen nothing, as here
        assert [c["verdict"] for c in answer["candidates"]] == ["recommended", "healthy", "healthy"]
        assert answer["recommended"]["path"] == "/c/990"
    # Rollup extremes 9.8 and 10.2: median 10, MAD 0.2, floored spread 0.5 x k=4.
    assert "within baseline 10±2" in answer["candidates"][0]["reasons"][0]


def test_incident_onset_chains_precursors() -> None:
    config = AdvisorConfig()
    spans = [
        AlertSpan("activation_norm_spike", "", "warning", 100, 130, None),  # fired late
        AlertSpan("skip_rate", "", "warning", 60, 62, 70),  # closed 40 steps before: chained
        AlertSpan("underflow_risk", "fc", "warning", 0, 5, None),  # not a precursor
        AlertSpan("loss_scale_collapse", "", "critical", 110, 112, None),
        AlertSpan("loss_scale_collapse", "", "critical", 500, 501, None),  # a later incident
    ]
    assert incident_onset(spans, config=config) is not None
    assert incident_onset(spans, config=config).step == 60  # type: ignore[union-attr]
    gap = AdvisorConfig(incident_gap=10)
    assert incident_onset(spans, config=gap).step == 100  # type: ignore[union-attr]
    pending_critical = [AlertSpan("loss_scale_collapse", "", "critical", 110, None, None)]
    assert incident_onset(pending_critical, config=config) is None
    assert margin_for(100_000, config=config) == 2000
    assert margin_for(None, config=config) == 20


@SQLITE_ONLY
def test_cli_table_and_run_resolution(
    collector: Any, client: httpx.Client, crash_run: int, capsys: pytest.CaptureFixture[str]
) -> None:
    url = collector.url
    assert main(["restart-candidates", "gpt-crash", "--url", url]) == 0
    table = capsys.readouterr().out
    onset = "incident onset at step 152 (activation_norm_spike); margin 20 steps"
    assert f"run {crash_run}: {onset}\n" in table
    assert "recommended: step 100  /ckpt/100.pt" in table
    row_100 = next(line for line in table.splitlines() if line.strip().startswith("100 "))
    assert row_100.split() == ["100", "recommended", "65536", "9.8", "/ckpt/100.pt"]
    assert "- loss scale 0.25 < 1" in table

    assert main(["restart-candidates", "crash-run", "--url", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recommended"]["step"] == 100
    assert main(["restart-candidates", str(crash_run), "--url", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run_id"] == crash_run

    # A second run with the same name makes the name ambiguous; its client id does not.
    assert client.post(INGEST_PATH, json=crafted_batch("crash-run-2")).status_code == 200
    assert main(["restart-candidates", "gpt-crash", "--url", url]) == 1
    assert "2 runs are named 'gpt-crash'" in capsys.readouterr().err
    assert main(["restart-candidates", "nope", "--url", url]) == 1
    assert "no run with id, client run id or name 'nope'" in capsys.readouterr().err


@SQLITE_ONLY
def test_reads_stay_near_each_checkpoint(collector: Any, client: httpx.Client) -> None:
    """On a 6,000-step run the advisor reads a bounded window of steps per checkpoint and
    a bounded number of rollups, never the whole run."""
    for seq in range(3):
        first = seq * 2000
        steps = [
            step_record(s, loss=1.0, loss_scale=65536.0, act_norm_mean=10.0)
            for s in range(first, first + 2000)
        ]
        events = [checkpoint(s, f"/c/{s}") for s in range(first + 500, first + 2000, 500)]
        batch = make_batch(seq, client_run_id="long-reads", steps=steps, events=events)
        assert client.post(INGEST_PATH, json=dict(batch)).status_code == 200
    run_id = client.get("/api/v1/runs").json()["runs"][0]["id"]
    engine = make_engine(collector.database_url)
    statements: list[str] = []

    @event.listens_for(engine, "before_cursor_execute")
    def capture(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(" ".join(statement.split()))

    try:
        with make_sessionmaker(engine)() as session:
            answer = restart_candidates(session, run_id)
    finally:
        engine.dispose()
    assert answer.recommended is not None and answer.recommended.step == 5500
    assert len(answer.candidates) == 9
    step_reads = [s for s in statements if "FROM steps" in s]
    rollup_reads = [s for s in statements if "FROM step_rollups" in s]
    # One max(step) for the margin; every other read of steps is a BETWEEN window.
    assert sum("max(steps.step)" in s for s in step_reads) == 1
    assert all("BETWEEN" in s for s in step_reads if "max(steps.step)" not in s)
    assert rollup_reads and all("LIMIT" in s for s in rollup_reads)


def test_a_configuration_finding_is_a_caveat_not_an_incident(
    collector: Any, client: httpx.Client, crash_run: int
) -> None:
    """fp16_no_scaler_underflow: fp16_without_scaler fires (critical) from step 0 and never
    resolves; no checkpoint is free of it, and none would fix it. The checkpoints are judged
    by the incident (silent underflow from 130), each with the caveat."""
    set_alerts(
        collector.database_url,
        crash_run,
        [
            alert("fp16_without_scaler", "critical", 0, 0, None),
            alert("silent_underflow", "critical", 130, 140, None, layer="blocks.0.fc.weight"),
            alert("silent_underflow", "critical", 150, 160, None, layer="blocks.1.fc.weight"),
        ],
    )
    answer = client.get(f"/api/v1/runs/{crash_run}/restart-candidates").json()
    assert (answer["onset_step"], answer["onset_rule"]) == (130, "silent_underflow")
    assert answer["recommended"]["step"] == 100
    c = by_step(answer)
    caveat = "the run trains FP16 without a loss scaler: fix that before restarting"
    assert all(candidate["reasons"][-1] == caveat for candidate in answer["candidates"])
    assert c[100]["reasons"][0].startswith("latest healthy checkpoint: scale 65536")
    assert not any("fp16_without_scaler" in reason for reason in c[100]["reasons"])


@SQLITE_ONLY
def test_healthy_loss_scale_follows_the_runs_collapse_settings(
    client: httpx.Client, crash_run: int
) -> None:
    put = client.put(f"/api/v1/runs/{crash_run}/alert-config",
                     json={"rules": {"loss_scale_collapse": {"min_scale": 100000.0}}})  # fmt: skip
    assert put.status_code == 200, put.text
    url = f"/api/v1/runs/{crash_run}/restart-candidates"
    answer = client.get(url).json()
    assert answer["recommended"] is None
    assert "loss scale 65536 < 100000" in by_step(answer)[100]["reasons"]
    # The query parameter still wins.
    assert client.get(url, params={"healthy_loss_scale": 1}).json()["recommended"]["step"] == 100


def test_the_recommendation_names_the_data_to_skip(client: httpx.Client, crash_run: int) -> None:
    from ampwatch.server.cli.remote import format_restart_candidates

    answer = client.get(f"/api/v1/runs/{crash_run}/restart-candidates").json()
    skip = answer["skip_steps"]
    # From the step after the recommended checkpoint (100) to the onset (152) + the margin.
    assert (skip["start"], skip["end"]) == (101, 152 + 20)
    assert "onset at step 152 (activation_norm_spike)" in skip["reason"]
    assert "skip data: steps 101-172 (the batches from the checkpoint" in (
        format_restart_candidates(answer)
    )


def test_never_a_checkpoint_at_or_after_the_first_non_finite_loss(
    collector: Any, client: httpx.Client
) -> None:
    """A NaN loss with no alert at all (nan_loss off, say): checkpoints from its step on are
    rejected; the one before it is recommended; a run without an incident skips nothing."""
    steps = [step_record(s, loss=float("nan") if s == 230 else 2.0, loss_scale=65536.0,
                         act_norm_mean=10.0) for s in range(300)]  # fmt: skip
    events = [checkpoint(s, f"/n/{s}.pt") for s in (100, 200, 230, 260)]
    batch = make_batch(0, client_run_id="nan-run", steps=steps, events=events)
    response = client.post(INGEST_PATH, json=dict(batch))
    run_id = int(response.json()["run_id"])
    set_alerts(collector.database_url, run_id, [])  # whatever the engine said: none
    answer = client.get(f"/api/v1/runs/{run_id}/restart-candidates").json()
    verdicts = {c["step"]: c for c in answer["candidates"]}
    assert answer["recommended"]["step"] == 200
    for step in (230, 260):
        assert verdicts[step]["verdict"] == "rejected"
        assert any("first non-finite loss (step 230)" in r for r in verdicts[step]["reasons"])
    assert answer["skip_steps"] is None  # no incident reached critical
