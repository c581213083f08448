"""The real-log corpus: public training-log excerpts (`tests/data/real_logs/`), parsed and
replayed through the agent's manual API (`handle.record()`) into a real collector over HTTP,
and judged against what their sources say happened (`labels.json`).

Every incident must be alerted by its deadline, and no later than any peer's published
rule computed on the same series; healthy and self-recovering runs get no critical alert.
"""

from __future__ import annotations

import pytest
from real_logs import (
    CORPUS,
    KNOWN_LATER,
    PEERS,
    corpus,
    labels,
    load_excerpt,
    logged_attempts,
    replay_and_judge,
)

CASES = corpus()


def test_every_excerpt_has_provenance_and_a_label() -> None:
    logs = sorted(p.stem for p in CORPUS.glob("*.log"))
    assert logs == sorted(labels()), "every excerpt needs a label, every label an excerpt"
    for excerpt, label in CASES:
        header = (CORPUS / f"{excerpt.name}.log").read_text(encoding="utf-8")
        assert excerpt.source.startswith("https://github.com/"), excerpt.name
        assert "# repository: " in header and excerpt.steps, excerpt.name
        assert label.kind in {"incident", "healthy", "transient", "unlabeled"}, excerpt.name
        assert (label.deadline_step is not None) == (label.kind == "incident"), excerpt.name
        if label.kind == "incident":
            assert label.deadline_step in {s.step for s in excerpt.steps}, excerpt.name
    kinds = [label.kind for _, label in CASES]
    assert kinds.count("incident") >= 7 and kinds.count("healthy") >= 3


def test_the_parsers_read_what_the_logs_say() -> None:
    burst = load_excerpt(CORPUS / "tr8b-104B-exp07-resume-burst.log")
    assert [s.step for s in burst.steps if s.skipped] == [17062, 17063, 17064, 17065, 17067, 17068]
    assert burst.steps[2].loss == pytest.approx(4.374269)
    assert [s.loss_scale for s in burst.steps][2:6] == [2.0**20, 2.0**20, 2.0**19, 2.0**18]
    assert burst.steps[6].grad_norm == pytest.approx(879946.622)  # applied: its own norm
    fairseq = load_excerpt(CORPUS / "fairseq-512-min-scale.log")
    assert fairseq.steps[0].loss_scale == 0.5 and not fairseq.steps[0].skipped
    assert [s.step for s in fairseq.steps if s.skipped] == list(range(10199, 10211))
    assert fairseq.steps[-1].loss_scale == pytest.approx(2 * 0.0001220703125)
    tqdm = load_excerpt(CORPUS / "chinese-llama-534-min-scale.log")
    skipped = {s.step: s.loss_scale for s in tqdm.steps if s.skipped}
    assert skipped == {249: 2048, 379: 64, 380: 32, 381: 16, 382: 8, 383: 4}
    ckpt = load_excerpt(CORPUS / "fairseq-1895-min-scale.log")
    assert ckpt.checkpoints == [(695, "checkpoints_en_de_parallel/checkpoint2.pt")]
    assert ckpt.steps[0].loss_scale is None  # printed "0": rounded away, not measured


def test_the_deepspeed_engine_parser_replays_the_scaler_the_log_prints() -> None:
    """Every attempt is a step, skipped exactly as often as `skipped=K` says, and the
    replayed scaler attempts each overflow at the scale its OVERFLOW line prints (the check
    on the inferred scale between overflows, which DeepSpeed's ZeRO scaler never logs)."""
    for name, attempts, skips in (("deepspeed-chat-sft-opt1.3b", 7360, 139),
                                  ("deepspeed-chat-rm-opt350m", 1840, 20)):  # fmt: skip
        path = CORPUS / f"{name}.log"
        excerpt = load_excerpt(path)
        assert [s.step for s in excerpt.steps] == list(range(1, attempts + 1)), name
        skipped = [s for s in excerpt.steps if s.skipped]
        assert len(skipped) == skips, name
        assert [s.loss_scale for s in skipped] == logged_attempts(path), name
    rm = load_excerpt(CORPUS / "deepspeed-chat-rm-opt350m.log")
    assert [s.step for s in rm.steps if s.skipped][10:14] == [146, 483, 486, 487]


def test_the_peer_rules_fire_where_their_definitions_say() -> None:
    from real_logs import Step, lightning_spike, megatron_spiky_loss, olmo_core_spike

    flat = [Step(i, loss=2.0 + 0.01 * (i % 3)) for i in range(1, 200)]
    spiked = [*flat, Step(200, loss=25.0)]
    assert megatron_spiky_loss(flat) == [] and megatron_spiky_loss(spiked) == [200]
    assert olmo_core_spike(flat) == [] and olmo_core_spike(spiked) == [200]
    assert lightning_spike(spiked)[-1] == 200 and 200 - 1 not in lightning_spike(spiked)
    assert set(PEERS) >= {"megatron_10x_first100", "olmo_6sigma_128", "lightning_spike"}


@pytest.mark.parametrize("case", CASES, ids=[excerpt.name for excerpt, _ in CASES])
def test_replay(case, live_collector) -> None:  # type: ignore[no-untyped-def]
    excerpt, label = case
    verdict = replay_and_judge(excerpt, label, live_collector.url)
    problems = verdict.problems()
    for (name, peer), steps in KNOWN_LATER.items():
        theirs = verdict.peer_caught(peer) if name == excerpt.name else None
        if theirs is not None and verdict.first_alert is not None:
            assert verdict.first_alert - theirs <= steps, (name, peer)
            problems = [p for p in problems if not p.startswith(f"{peer} flagged it")]
    assert not problems, f"{excerpt.name} ({label.kind}): {problems}"
    if label.kind == "healthy":
        assert verdict.alerts == [], f"{excerpt.name}: {verdict.alerts}"


def test_the_reported_floor_decides_fairseq_1895_at_its_first_low_skip(live_collector) -> None:  # type: ignore[no-untyped-def]
    """With fairseq's floor reported (1e-4, the error the issue quotes) the first skip, 2^3.3
    above it, fires at 701, with the fixed min_scale of 1; without it the engine falls back
    to min_scale 1 and waits for a second low skip (702). The healthy run steady at 0.5
    stays quiet either way."""
    cases = {excerpt.name: (excerpt, label) for excerpt, label in CASES}
    excerpt, label = cases["fairseq-1895-min-scale"]
    assert excerpt.min_loss_scale == 1e-4
    reported = replay_and_judge(excerpt, label, live_collector.url)
    fallback = replay_and_judge(excerpt, label, live_collector.url, report_floor=False)
    assert (reported.first_alert, fallback.first_alert) == (701, 702)
    (alert,) = reported.alerts
    assert "above the scaler's floor 0.0001" in alert["message"]
    healthy, quiet = cases["fairseq-2493-steady-half"]
    for report_floor in (True, False):
        verdict = replay_and_judge(healthy, quiet, live_collector.url, report_floor=report_floor)
        assert verdict.alerts == [], report_floor
