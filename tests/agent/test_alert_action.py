"""From alert to action, with real FP16 training on the CPU against a real collector:
the ingest answer carries the run's firing alerts, `on_critical` acts on the training
thread, the resume plan names a checkpoint and the batches to skip, and a relaunch from
it trains on healthy past the old failure point (`ampwatch.agent.policy`,
`ampwatch.server.resume_plan`)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch import nn

from ampwatch.agent import EXIT_CRITICAL_ALERT, CriticalAlert, ResumeFrom, load_resume_plan, watch
from ampwatch.agent.data_position import DataPositions
from ampwatch.agent.delivery import DeliveryOptions
from ampwatch.agent.policy import AlertPolicy, FiringAlert
from ampwatch.server.demo import VOCAB, synthetic_batches, tiny_lm
from ampwatch.server.migrate import upgrade
from ampwatch.server.resume_plan import position_at
from ampwatch.server.schemas.runs import AckAlert, IngestAck
from ampwatch.server.serving import BackgroundCollector, bind_socket
from ampwatch.server.settings import Settings

#: A runaway lr schedule (the demo's, faster): it grows 15% a step; the grad norm spikes
#: around step 40, the activation norm and the loss around 50, then NaN (measured).
DIVERGING_LR: Callable[[int], float] = lambda step: 1e-3 * 1.15 ** (step - 1)  # noqa: E731
CHECKPOINT_EVERY = 10


def _ack(*alerts: AckAlert) -> bytes:
    """An acknowledgement as the collector's own schema writes it."""
    ack = IngestAck(run_id=1, stream="s", seq=0, duplicate=False, alerts=list(alerts))
    return ack.model_dump_json().encode()


CRITICAL = AckAlert(id=7, rule="loss_scale_collapse", layer="", severity="critical", step=120)
WARNING = AckAlert(id=3, rule="grad_norm_spike", layer="", severity="warning", step=100)


def test_warn_logs_each_critical_alert_once_and_never_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy = AlertPolicy("warn")
    with caplog.at_level(logging.WARNING, "ampwatch.agent"):
        policy.hear(_ack(WARNING))
        assert policy.firing == (FiringAlert(3, "grad_norm_spike", "", "warning", 100),)
        assert not caplog.records  # a warning alert is listed, not acted on
        for _ in range(3):
            policy.hear(_ack(CRITICAL, WARNING))
    assert [r.getMessage().count("loss_scale_collapse") for r in caplog.records] == [1]
    assert not policy.should_stop and policy.exit_code == 0
    policy.at_boundary(None)  # nothing due


def test_stop_sets_the_flag_and_the_exit_code() -> None:
    policy = AlertPolicy("stop")
    policy.hear(_ack(WARNING))
    assert not policy.should_stop and policy.exit_code == 0
    policy.hear(_ack(CRITICAL))
    assert policy.should_stop and policy.exit_code == EXIT_CRITICAL_ALERT == 75


def test_raise_waits_for_the_training_threads_step_boundary() -> None:
    policy = AlertPolicy("raise")
    heard = threading.Thread(target=policy.hear, args=(_ack(CRITICAL),))
    heard.start()
    heard.join()  # the sender thread's side raised nothing
    with pytest.raises(CriticalAlert) as raised:
        policy.at_boundary(None)
    assert raised.value.code == EXIT_CRITICAL_ALERT
    assert [a.rule for a in raised.value.alerts] == ["loss_scale_collapse"]
    assert "loss_scale_collapse" in str(raised.value)
    policy.at_boundary(None)  # raised once
    policy.hear(_ack(CRITICAL))
    policy.at_boundary(None)  # the same alert again: not again


def test_a_callable_gets_the_new_critical_alerts_and_odd_answers_change_nothing() -> None:
    calls: list[tuple[object, tuple[FiringAlert, ...]]] = []
    policy = AlertPolicy(lambda handle, alerts: calls.append((handle, alerts)))
    for body in (b"", b"not json", b'{"alerts": 5}', b'{"run_id": 1}', b'{"alerts": [{}]}'):
        policy.hear(body)
    assert policy.firing == () and calls == []
    policy.hear(_ack(CRITICAL))
    policy.hear(b"{}")  # an answer without alerts (an older collector): the state stands
    assert policy.firing[0].id == 7
    policy.at_boundary("handle")
    assert calls == [("handle", (FiringAlert(7, "loss_scale_collapse", "", "critical", 120),))]
    with pytest.raises(ValueError, match="on_critical"):
        AlertPolicy("halt")  # type: ignore[arg-type]


def test_alerts_a_resume_plan_abandoned_are_not_acted_on_again() -> None:
    policy = AlertPolicy("stop", ignore=[7])
    policy.hear(_ack(CRITICAL))
    assert not policy.should_stop
    policy.hear(_ack(CRITICAL.model_copy(update={"id": 8})))
    assert policy.should_stop


def test_data_positions_are_sent_sparsely_and_read_back_exactly() -> None:
    """The loop's (step -> first batch) map, through the sparse events and `position_at`,
    comes back exactly: two epochs of 2 batches a step, then a resumed loader that skips."""
    truth: dict[int, tuple[int, int]] = {}
    for step in range(1, 51):
        truth[step] = (0, 2 * (step - 1)) if step <= 30 else (1, 2 * (step - 31))
    for step in range(51, 61):
        truth[step] = (1, 100 + 2 * (step - 51))
    positions = DataPositions()
    noted = [
        positions.note(step, epoch, batch + micro)  # a second micro-batch's report is ignored
        for step, (epoch, batch) in truth.items()
        for micro in range(2)
    ]
    events = [(s, (d["epoch"], d["batch"], d["stride"])) for s, d in filter(None, noted)]
    assert len(events) == 6  # anchor, anchor with its stride; per stretch
    assert {s: position_at(events, s)[:2] for s in truth} == truth  # type: ignore[index]
    with pytest.raises(ValueError):
        positions.note(61, 0, -1)


# -- real runs ------------------------------------------------------------------------


@dataclass
class Trained:
    handle: Any
    last_step: int
    losses: dict[int, float] = field(default_factory=dict)
    batches: dict[int, int] = field(default_factory=dict)  # step -> batch_idx consumed
    checkpoints: dict[int, Path] = field(default_factory=dict)


def train(
    url: str,
    folder: Path,
    *,
    steps: int,
    lr: Callable[[int], float],
    on_critical: Any = "stop",
    plan: ResumeFrom | None = None,
    delivery: DeliveryOptions | None = None,
    between_steps: Callable[[int, Any], None] = lambda step, handle: time.sleep(0.01),
    poison_at: int | None = None,
) -> Trained:
    """The demo's tiny LM in FP16 (autocast, GradScaler), checkpoints every 10 steps and at
    a stop; a relaunch from `plan` loads its checkpoint and skips the batches it lists.
    `between_steps` stands for the rest of a real step's time (data, logging);
    `poison_at`: that step's loss is NaN (a bad batch), which `nan_loss` judges critical."""
    torch.set_num_threads(1)
    model = tiny_lm(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=50)
    step = 0
    if plan is not None:
        assert plan.path is not None
        state = torch.load(plan.path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        step = plan.step
    handle = watch(
        model, optimizer, scaler, run="diverging", url=url, flush_interval=0.05,
        on_critical=on_critical, resume_from=plan, delivery=delivery,
    )  # fmt: skip
    run = Trained(handle, step)
    data = synthetic_batches(0)
    batch_idx = -1
    try:
        while step < steps:
            tokens, targets = next(data)
            batch_idx += 1
            if plan is not None and (batch_idx < plan.step or plan.skips(batch_idx)):
                continue  # consumed before the checkpoint, or to skip
            step += 1
            handle.data_position(batch_idx)
            run.batches[step] = batch_idx
            for group in optimizer.param_groups:
                group["lr"] = lr(step)
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(tokens)
            loss = nn.functional.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))
            if step == poison_at:
                loss = loss * math.nan
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            run.losses[step] = loss.item()
            if step % CHECKPOINT_EVERY == 0 or handle.should_stop:
                path = folder / f"step{step}.pt"
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "scaler": scaler.state_dict()}  # fmt: skip
                handle.save_checkpoint(state, path, step)
                run.checkpoints[step] = path
            if handle.should_stop:
                break
            between_steps(step, handle)
    except CriticalAlert:
        handle.detach("failed", reason="critical alert")
        raise
    run.last_step = step
    handle.detach("stopped" if handle.should_stop else "finished")
    return run


@dataclass
class Story:
    url: str
    api: httpx.Client
    run_id: int
    diverged: Trained
    plan: dict[str, Any]
    resumed: Trained
    #: `ampwatch resume-plan RUN --json` / without `--json`, and the skip_batches.json
    #: written, before the relaunch (the plan a relaunch script reads).
    cli_json: str = ""
    cli_words: str = ""
    cli_skip_file: str = ""


def _cli(*argv: str) -> tuple[int, str]:
    from ampwatch.server import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(list(argv))
    return code, out.getvalue()


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Story]:
    """Diverge with on_critical="stop", fetch the plan, relaunch from it (with its lr)."""
    folder = tmp_path_factory.mktemp("alert-action")
    database = f"sqlite:///{folder}/collector.sqlite"
    upgrade(database)
    sock = bind_socket()
    settings = Settings(database_url=database, port=sock.getsockname()[1], dashboard=False)
    with (
        BackgroundCollector(settings, sock=sock) as collector,
        httpx.Client(base_url=f"{collector.url}/api/v1") as api,
    ):
        diverged = train(collector.url, folder, steps=400, lr=DIVERGING_LR)
        run_id = api.get("/runs").json()["runs"][0]["id"]
        plan = api.get(f"/runs/{run_id}/resume-plan").json()
        (folder / "plan.json").write_text(json.dumps(plan))
        run, skip_file = diverged.handle.client_run_id, folder / "skip_batches.json"
        as_json = _cli("resume-plan", run, "--url", collector.url, "--json",
                       "--skip-batches", str(skip_file))  # fmt: skip
        as_words = _cli("resume-plan", run, "--url", collector.url)
        assert as_json[0] == as_words[0] == 0
        resumed_plan = load_resume_plan(folder / "plan.json")
        constant = float(resumed_plan.advice["lr"])
        resumed = train(
            collector.url, folder, steps=diverged.last_step + 20, lr=lambda step: constant,
            plan=resumed_plan,
        )  # fmt: skip
        yield Story(
            collector.url, api, run_id, diverged, plan, resumed,
            as_json[1], as_words[1], skip_file.read_text(),
        )  # fmt: skip


def test_a_diverging_fp16_run_stops_after_a_final_checkpoint(story: Story) -> None:
    run = story.diverged
    alerts = story.api.get(f"/runs/{story.run_id}/alerts").json()["alerts"]
    critical = [a for a in alerts if a["severity"] == "critical"]
    first_fired = min(a["fired_step"] for a in critical)
    assert run.handle.should_stop and run.handle.exit_code == EXIT_CRITICAL_ALERT
    # It stopped after the alert fired, long before the 400 steps it was given, and
    # saved its last checkpoint at the stop, which the collector recorded.
    assert first_fired < run.last_step < 400
    assert max(run.checkpoints) == run.last_step
    saved = story.api.get(f"/runs/{story.run_id}/checkpoints").json()["checkpoints"]
    assert str(run.checkpoints[run.last_step]) in {c["path"] for c in saved}
    print(f"\ncritical alert fired at step {first_fired}; the loop stopped at {run.last_step}")


def test_the_plan_names_a_checkpoint_before_the_onset_and_the_batches_to_skip(
    story: Story,
) -> None:
    plan, run = story.plan, story.diverged
    assert plan["ready"] and plan["client_run_id"] == run.handle.client_run_id
    checkpoint, onset = plan["checkpoint"], plan["onset_step"]
    assert checkpoint["step"] < onset <= run.last_step
    assert checkpoint["path"] == str(run.checkpoints[checkpoint["step"]])
    assert any("latest healthy checkpoint" in reason for reason in checkpoint["reasons"])
    skip = plan["skip"]
    assert skip["start"] == checkpoint["step"] + 1 and skip["end"] >= onset
    # The batches are the ones the loop itself consumed at those steps.
    consumed = [run.batches[s] for s in range(skip["start"], min(skip["end"], run.last_step) + 1)]
    assert skip["skip_batches"][: len(consumed)] == consumed
    assert skip["steps_without_position"] == 0
    advice = {a["setting"]: a for a in plan["advice"]}
    lr_at_checkpoint = DIVERGING_LR(checkpoint["step"])
    assert advice["lr"]["value"] == pytest.approx(lr_at_checkpoint / 2, rel=1e-6)
    assert {"init_scale", "growth_interval"} <= set(advice)
    assert all(a["reason"] for a in plan["advice"])


def test_relaunching_from_the_plan_trains_healthy_past_the_old_failure(story: Story) -> None:
    run, old = story.resumed, story.diverged
    assert run.last_step == old.last_step + 20 and not run.handle.should_stop
    assert min(run.losses) == story.plan["checkpoint"]["step"] + 1
    assert all(math.isfinite(loss) for loss in run.losses.values())
    skipped = set(story.plan["skip"]["skip_batches"])
    assert skipped and not skipped & set(run.batches.values())
    alerts = story.api.get(f"/runs/{story.run_id}/alerts").json()["alerts"]
    assert all(a["status"] == "resolved" for a in alerts if a["severity"] == "critical")
    assert {a["id"] for a in alerts if a["severity"] == "critical"} <= set(
        story.plan["firing_alert_ids"]
    )  # no new critical alert on the resumed branch
    events = story.api.get(f"/runs/{story.run_id}/events").json()["events"]
    resumed = [e for e in events if e["kind"] == "resumed"]
    assert [e["data"]["from_step"] for e in resumed] == [story.plan["checkpoint"]["step"]]


def test_a_plan_after_the_healthy_relaunch_answers_its_branch(story: Story) -> None:
    """The first incident belongs to the abandoned branch: a plan made after the relaunch
    finds no incident in the live branch and names its latest checkpoint, not one before
    the first incident's onset."""
    plan = story.api.get(f"/runs/{story.run_id}/resume-plan").json()
    assert plan["onset_step"] is None and plan["skip"] is None
    assert plan["checkpoint"]["step"] == max(story.resumed.checkpoints)
    assert plan["checkpoint"]["step"] > story.diverged.last_step


def test_a_healthy_run_with_the_policy_on_never_stops(tmp_path: Path, sqlite_url: str) -> None:
    upgrade(sqlite_url)
    sock = bind_socket()
    settings = Settings(database_url=sqlite_url, port=sock.getsockname()[1], dashboard=False)
    with BackgroundCollector(settings, sock=sock) as collector:
        run = train(collector.url, tmp_path, steps=50, lr=lambda step: 1e-3)
        alerts = httpx.get(f"{collector.url}/api/v1/alerts").json()["alerts"]
    assert run.last_step == 50 and not run.handle.should_stop and run.handle.exit_code == 0
    assert not [a for a in alerts if a["severity"] == "critical"]
    assert run.handle.counters["batches_sent"] > 0


def test_collector_down_the_loop_never_waits_and_the_policy_applies_when_it_returns(
    tmp_path: Path, sqlite_url: str
) -> None:
    """A collector that accepts connections but does not answer: the sender thread hangs
    in its POST (10 s timeout) while the loop trains through a NaN loss; once the
    collector serves that socket, the answers bring the alerts and the loop stops."""
    upgrade(sqlite_url)
    sock = bind_socket()
    sock.listen()  # connections queue; nothing answers yet
    settings = Settings(database_url=sqlite_url, port=sock.getsockname()[1], dashboard=False)
    url = settings.public_url
    collector: list[BackgroundCollector] = []
    down_until = 30  # past the bad batch of step 10
    seen_down: list[tuple[int, bool, int]] = []

    def between(step: int, handle: Any) -> None:
        if step < down_until:
            return  # as fast as it trains: nothing answers, nothing waits
        if step == down_until:
            seen_down.append((step, handle.should_stop, handle.counters["batches_sent"]))
            collector.append(BackgroundCollector(settings, sock=sock).start())
        time.sleep(0.02)

    try:
        started = time.monotonic()
        run = train(url, tmp_path, steps=400, lr=lambda step: 1e-3, between_steps=between,
                    delivery=DeliveryOptions(retry_cap=0.5), poison_at=10)  # fmt: skip
        elapsed = time.monotonic() - started
    finally:
        for served in collector:
            served.stop()
    # While down: 30 steps ran and nothing was acknowledged, nothing stopped.
    assert seen_down == [(down_until, False, 0)]
    # Back: the answers carried the critical alert and the loop stopped on it.
    assert run.handle.should_stop and down_until < run.last_step < 400
    print(f"\n{down_until} steps while down; stopped at {run.last_step} ({elapsed:.1f} s)")


def test_raise_interrupts_the_loop_at_a_step_boundary(tmp_path: Path, sqlite_url: str) -> None:
    """Raised on the training thread at whichever step boundary comes first after the alert
    arrives (the scaler's update, the optimizer's step hook, `log_loss`, `data_position`:
    which one is a race with the sender), never on the sender thread (`hear`)."""
    upgrade(sqlite_url)
    sock = bind_socket()
    settings = Settings(database_url=sqlite_url, port=sock.getsockname()[1], dashboard=False)
    deadline = time.monotonic() + 120  # steps run until the alert comes: a busy CI is slow

    def until_deadline(step: int, handle: Any) -> None:
        if time.monotonic() > deadline:
            pytest.fail(f"no critical alert raised in 120 s ({step} steps)")
        time.sleep(0.01)

    with (
        BackgroundCollector(settings, sock=sock) as collector,
        pytest.raises(CriticalAlert) as raised,
    ):
        train(collector.url, tmp_path, steps=10**9, lr=lambda step: 1e-3, on_critical="raise",
              poison_at=5, between_steps=until_deadline)  # fmt: skip
    assert raised.value.code == EXIT_CRITICAL_ALERT
    frames = [frame.name for frame in raised.traceback]
    assert frames[-1] == "at_boundary" and "hear" not in frames
    assert {"train", "_at_boundary"} <= set(frames)


def test_offline_mode_says_once_that_no_alert_can_come_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, "ampwatch.agent"):
        handle = watch(model, optimizer, offline_file=tmp_path / "run.aw", on_critical="stop")
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        handle.detach()
    said = [r for r in caplog.records if "no alert can come back" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "offline" in said[0].getMessage() and handle.alerts == () and not handle.should_stop


def test_the_cli_prints_the_plan_and_writes_skip_batches_json(
    story: Story, capsys: pytest.CaptureFixture[str]
) -> None:
    from ampwatch.server import cli

    plan = story.plan  # before the relaunch, as the CLI printed it then
    assert json.loads(story.cli_json) == plan
    assert json.loads(story.cli_skip_file) == plan["skip"]["skip_batches"]
    words = story.cli_words
    checkpoint = plan["checkpoint"]
    assert f"checkpoint: step {checkpoint['step']}  {checkpoint['path']}" in words
    assert "set lr = " in words and "epoch 0: batches" in words
    assert cli.main(["resume-plan", "no-such-run", "--url", story.url]) == 1
    assert "no run with id" in capsys.readouterr().err
    assert story.api.get("/runs/999999/resume-plan").status_code == 404
    assert story.api.get(f"/runs/{story.run_id}/resume-plan?margin_steps=-1").status_code == 422
