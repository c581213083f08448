"""Golden tests of the log parsers (`ampwatch.agent.logs`) on public excerpts: the parsed
series says, line by line, what the log says, for every quirk the README lists.

| quirk | excerpt |
|---|---|
| OVERFLOW "reducing to" the same value (hysteresis) is still a skip | real_logs/tr8b-104B-exp07-resume-burst |
| "but hysteresis is N" form | real_logs/deepspeed-5779-warmup, log_formats/deepspeed-chat-rlhf-actor-critic |
| the same line once per rank | log_formats/deepspeed-chat-rm-rank-copies |
| two engines in one log | log_formats/deepspeed-chat-rlhf-actor-critic |
| Megatron's skipped counter 0 while OVERFLOW lines skip | real_logs/tr8b-104B-exp07-resume-burst |
| per-interval lines | real_logs/tr8-104B-exp2-glitch, real_logs/tr1-13B-spike |
| no scale reported | real_logs/tr11-176B-bf16-spike |
| fairseq's rounded loss_scale 0 | real_logs/fairseq-1895-min-scale |
| scales far below any floor (1e-205) | log_formats/apex-318-tiny-scale |
| the grad norm repeated on a skipped iteration, missing lm loss | real_logs/tr8-104B-exp12-divergence |
| all-skipped interval, rank prefixes, checkpoint saves | log_formats/hyperpod-megatron-checkpoint |
| HF dicts inside tqdm bars | real_logs/chinese-llama-534-min-scale |
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ampwatch.agent.logs import LogParseError, LogStep, detect_format, make_parser
from ampwatch.agent.logs.importer import iter_lines, parse_lines
from ampwatch.agent.logs.series import Checkpoint, Entry, Restart, measured_scale

DATA = Path(__file__).resolve().parents[1] / "data"


def parse(name: str, fmt: str = "auto") -> tuple[str, list[Entry]]:
    """An excerpt's entries, its provenance header left out (but a `# scaler:` line)."""
    path = DATA / name
    lines = [(n, t) for n, t in iter_lines(path.read_bytes())
             if not t.startswith("# ") or t.startswith("# scaler:")]  # fmt: skip
    chosen, _, entries = parse_lines(lines, fmt, str(path))
    return chosen, entries


def steps(name: str, fmt: str = "auto") -> list[LogStep]:
    return [e for e in parse(name, fmt)[1] if isinstance(e, LogStep)]


def by_step(name: str) -> dict[int, LogStep]:
    return {s.step: s for s in steps(name)}


def test_megatron_deepspeed_overflow_lines_skip_whatever_the_counter_says() -> None:
    burst = by_step("real_logs/tr8b-104B-exp07-resume-burst.log")
    # "Attempted loss scale: 1048576.0, reducing to 1048576.0" (hysteresis): still skipped
    assert burst[17062].skipped and burst[17062].loss_scale == 2.0**20
    assert burst[17063].skipped and burst[17063].loss_scale == 2.0**20  # reduced to 2^19 after
    assert burst[17064].loss_scale == 2.0**19
    assert not burst[17061].skipped and burst[17061].loss == pytest.approx(2.667121)
    assert burst[17062].grad_norm is None  # on a skipped iteration the norm is not its own
    assert burst[17066].grad_norm == pytest.approx(879946.622)  # applied: its own norm
    assert [s for s, v in burst.items() if v.skipped] == [17062, 17063, 17064, 17065, 17067, 17068]


def test_megatron_repeated_grad_norm_and_missing_lm_loss_on_a_skipped_iteration() -> None:
    div = by_step("real_logs/tr8-104B-exp12-divergence.log")
    # 9027: "loss scale: 8192.0 | grad norm: 20609.780" (the 9026 norm again), no lm loss
    last = div[9027]
    assert last.loss is None and last.grad_norm is None
    assert last.skipped and last.loss_scale == 16384.0  # attempted at the scale before the fall
    assert div[9026].grad_norm == pytest.approx(20609.780) and not div[9026].skipped


def test_megatron_interval_lines_are_one_step_each_at_their_iteration() -> None:
    glitch = steps("real_logs/tr8-104B-exp2-glitch.log")
    assert [s.step for s in glitch] == [6900, 6910, 6920, 6930, 6940]
    assert [s.loss for s in glitch] == pytest.approx([6.365808, 6.598378, 7.314456, 9.121927,
                                                      10.23865])  # fmt: skip
    assert {s.loss_scale for s in glitch} == {4096.0} and not any(s.skipped for s in glitch)
    assert glitch[0].lr == pytest.approx(6e-5)
    spike = steps("real_logs/tr1-13B-spike.log")
    assert all(s.grad_norm is None for s in spike)  # "grad norm: 0.000": not computed
    assert [s.step % 10 for s in spike] == [0] * len(spike)


def test_megatron_without_a_loss_scale_reports_none() -> None:
    bf16 = steps("real_logs/tr11-176B-bf16-spike.log")
    assert bf16 and all(s.loss_scale is None for s in bf16)
    assert measured_scale(-1.0) is None and measured_scale(0.0) is None  # "loss scale: -1.0"
    assert measured_scale(2.0**-20) == 2.0**-20


def test_megatron_all_skipped_interval_rank_prefixes_and_one_checkpoint_per_save() -> None:
    fmt, entries = parse("log_formats/hyperpod-megatron-checkpoint.log")
    assert fmt == "megatron"
    (step,) = [e for e in entries if isinstance(e, LogStep)]
    assert (step.step, step.loss, step.grad_norm, step.skipped) == (1, None, None, True)
    assert step.loss_scale == 4294967296.0  # the scale after the interval, as printed
    assert [(c.step, c.path) for c in entries if isinstance(c, Checkpoint)] == [
        (1, "/fsx/checkpoints")
    ]  # "saving ..." and "successfully saved ..." are one save


def test_megatron_iteration_going_back_is_a_restart() -> None:
    text = (DATA / "real_logs/tr8-104B-exp2-glitch.log").read_text().splitlines()
    lines = [t for t in text if not t.startswith("# ")]
    parser = make_parser("megatron")
    out: list[Entry] = []
    for number, line in enumerate(lines + lines[:2], 1):  # the job resumed from 6900
        out += parser.feed(line, number)
    restarts = [e for e in out if isinstance(e, Restart)]
    assert [r.line for r in restarts] == [len(lines) + 1]
    assert [e.step for e in out if isinstance(e, LogStep)][-3:] == [6940, 6900, 6910]


def test_deepspeed_rank_copies_count_once() -> None:
    """16 ranks print 'Grad overflow on iteration i' each; one skipped attempt per i."""
    rm = steps("log_formats/deepspeed-chat-rm-rank-copies.log", "deepspeed")
    assert [(s.step, s.skipped, s.loss_scale) for s in rm] == [(1, True, 65536.0),
                                                               (2, True, 32768.0)]  # fmt: skip


def test_deepspeed_bare_overflow_lines_hysteresis_and_copies() -> None:
    warm = steps("real_logs/deepspeed-5779-warmup.log")
    # "Attempted loss scale: 65536, but hysteresis is 2" then "65536, reducing to 32768"
    assert [s.loss_scale for s in warm[:3]] == [65536.0, 65536.0, 32768.0]
    assert all(s.skipped for s in warm) and [s.step for s in warm] == list(range(1, len(warm) + 1))
    parser = make_parser("deepspeed")
    line = ("[INFO] [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 4096, "
            "reducing to 2048")  # fmt: skip
    floor = "[INFO] [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 1, reducing to 1"  # fmt: skip
    for number, text in enumerate([line, line, floor, floor], 1):
        parser.feed(text, number)
    out = [e for e in parser.finish() if isinstance(e, LogStep)]
    # a repeated transition is another rank's copy; repeats at the floor are real steps
    assert [s.loss_scale for s in out] == [4096.0, 1.0, 1.0]


def test_two_engines_in_one_log_are_told_apart() -> None:
    rlhf = steps("log_formats/deepspeed-chat-rlhf-actor-critic.log")
    actor = {s.step: s for s in rlhf if s.engine == "actor"}
    critic = {s.step: s for s in rlhf if s.engine == "critic"}
    assert sorted(actor) == sorted(critic) == list(range(11))
    assert [s for s in actor if actor[s].skipped] == [0, 1, 2, 5, 10]
    assert [s for s in critic if critic[s].skipped] == [0, 1, 2]
    # the log's own check: at step=10 one engine had skipped 4, the other 3
    assert sum(actor[s].skipped for s in range(10)) == 4
    assert sum(critic[s].skipped for s in range(10)) == 3
    assert actor[5].loss_scale == 16384.0 and actor[10].loss_scale == 8192.0
    assert critic[5].loss_scale == 16384.0 and not critic[5].skipped  # the scale it holds
    assert actor[0].loss == pytest.approx(0.2099609375)
    assert critic[0].loss == pytest.approx(0.12042236328125)


def test_hf_trainer_dicts_inside_tqdm_bars() -> None:
    llama = by_step("real_logs/chinese-llama-534-min-scale.log")
    assert {s: v.loss_scale for s, v in llama.items() if v.skipped} == {
        249: 2048, 379: 64, 380: 32, 381: 16, 382: 8, 383: 4}  # fmt: skip
    assert llama[250].loss == pytest.approx(1.89) and llama[250].lr == pytest.approx(
        0.00019920353585932578
    )
    assert llama[250].loss_scale == 1024.0  # the scale DeepSpeed reduced to at 249
    parser = make_parser("hf")
    redraws = " 1%|  | 6/100 [00:01<00:10]\r 1%|  | 7/100 [00:02<00:10]\r 1%|  | 8/100 [00"
    out = parser.feed(redraws, 1) + parser.feed("{'loss': 2.5, 'grad_norm': 0.75, 'epoch': 0.1}", 2)
    out += parser.finish()
    final = {e.step: e for e in out if isinstance(e, LogStep)}
    # the dict belongs to the last bar drawn (8), the redraws before it are steps 6 and 7
    assert sorted(final) == [6, 7, 8] and final[8].loss == 2.5 and final[8].grad_norm == 0.75
    assert final[7].loss is None


def test_fairseq_rounded_zero_scale_is_not_measured() -> None:
    fmt, entries = parse("real_logs/fairseq-1895-min-scale.log")
    assert fmt == "fairseq"
    first = next(e for e in entries if isinstance(e, LogStep))
    assert first.loss_scale is None and first.grad_norm == pytest.approx(55.005)
    assert [(c.step, c.path) for c in entries if isinstance(c, Checkpoint)] == [
        (695, "checkpoints_en_de_parallel/checkpoint2.pt")]  # fmt: skip


def test_metaseq_reads_the_final_layer_activation_norm() -> None:
    """A line in fairseq's train_inner layout with metaseq's actv_norm field (constructed:
    no public metaseq excerpt with the field was found in time; see the report)."""
    parser = make_parser("metaseq")
    line = ("2022-01-01 00:00:00 | INFO | train_inner | epoch 001: 100 / 1000 loss=2.5, "
            "loss_scale=4, gnorm=0.5, actv_norm=31.25, num_updates=100, lr=0.0001")  # fmt: skip
    (step,) = parser.feed(line, 1)
    assert isinstance(step, LogStep)
    assert (step.step, step.loss, step.loss_scale, step.grad_norm, step.act_norm) == (
        100, 2.5, 4.0, 0.5, 31.25)  # fmt: skip


def test_apex_scales_far_below_any_floor() -> None:
    tiny = steps("log_formats/apex-318-tiny-scale.log")
    assert tiny[0].loss_scale == 2 * 8.165126103939127e-202
    assert tiny[-1].loss_scale == 2 * 9.967194951097568e-206
    assert all(s.skipped for s in tiny) and len(tiny) == 14
    sub = make_parser("apex").feed(
        "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 8.3e-317", 1)  # fmt: skip
    assert isinstance(sub[0], LogStep) and sub[0].loss_scale == 2 * 8.3e-317  # a subnormal double


@pytest.mark.parametrize(
    ("name", "expected"),
    [("real_logs/tr8-104B-exp2-glitch.log", "megatron"),
     ("real_logs/tr8b-104B-exp07-resume-burst.log", "megatron-deepspeed"),
     ("real_logs/transformers-14531-floor-stall.log", "hf"),
     ("real_logs/chinese-llama-534-min-scale.log", "hf"),
     ("real_logs/cogvideo-233-warmup.log", "deepspeed"),
     ("real_logs/deepspeed-chat-sft-opt1.3b.log", "deepspeed"),
     ("log_formats/deepspeed-chat-rlhf-actor-critic.log", "deepspeed"),
     ("real_logs/fairseq-940-steady-scale.log", "fairseq"),
     ("log_formats/apex-318-tiny-scale.log", "apex")],
)  # fmt: skip
def test_auto_detection_chooses_and_says_why(name: str, expected: str) -> None:
    text = (DATA / name).read_text().splitlines()
    fmt, why = detect_format(t for t in text if not t.startswith("# "))
    assert fmt == expected
    assert "line" in why and "marker" in why


def test_a_file_without_a_step_names_its_first_line() -> None:
    with pytest.raises(LogParseError) as caught:
        parse_lines([(1, ""), (2, "hello world"), (3, "no log here")], "auto", "x.log")
    assert caught.value.line == 2 and "x.log:2" in str(caught.value)
    # A line that does not read is skipped, not a refusal; with nothing else, no step reads.
    with pytest.raises(LogParseError) as bad:
        parse_lines([(1, " iteration 10/ 100 | lm loss: 1.2.3E+00 |")], "megatron", "y.log")
    assert bad.value.line == 1 and "1 unreadable value (line 1)" in str(bad.value)
    assert list(iter_lines(b"ok\n\xff\xfe\n", "z.log")) == [(1, "ok"), (2, "\ufffd\ufffd")]
