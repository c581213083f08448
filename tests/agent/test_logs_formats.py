"""Golden tests of the formats and fixes of issue 31 (`ampwatch.agent.logs`): the values a
log prints are stored as printed, what it does not print is inferred and named, a line
that does not read is skipped and counted, and auto-detection looks past launcher noise.

Public excerpts (tests/data/log_formats/, provenance in each header) where one was found;
where none was, lines built from the printing code's own format string, said so at the test.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ampwatch.agent.logs import LogStep, detect_format, make_parser
from ampwatch.agent.logs.importer import iter_lines, read_lines
from ampwatch.agent.logs.reader import LineReader
from ampwatch.agent.logs.series import Checkpoint, Entry, Finding, Restart

DATA = Path(__file__).resolve().parents[1] / "data"


def read(name: str, fmt: str = "auto") -> tuple[str, str, list[Entry], LineReader]:
    lines = [(n, t) for n, t in iter_lines((DATA / name).read_bytes()) if not t.startswith("# ")]
    return read_lines(lines, fmt, name)


def steps_of(entries: list[Entry]) -> list[LogStep]:
    return [e for e in entries if isinstance(e, LogStep)]


def feed(fmt: str, lines: list[str]) -> tuple[list[LogStep], dict[str, str]]:
    reader = LineReader(make_parser(fmt))
    out: list[Entry] = []
    for number, line in enumerate(lines, 1):
        out += reader.feed(line, number)
    out += reader.finish()
    return steps_of(out), reader.inferred


# -- DeepSpeed engine logs: the printed values, never a replayed default ----------------

_STAMP = "[2024-01-01 06:{:02d}:{:02d},000] [INFO] [logging.py:96:log_dist] [Rank 0] "


def _ds(minute: int, second: int, text: str) -> str:
    return _STAMP.format(minute, second) + text


def test_deepspeed_stores_the_printed_scales_and_lr() -> None:
    """Issue 31: "Attempted loss scale: 65536, reducing to 32768", then "32768, reducing
    to 16384", then `step=10, skipped=2, lr=[1e-05]`: the skipped attempts at 65536 and
    32768, the attempts after them at 16384, and the lr at step 10 (the old parser stored
    no lr)."""
    steps, inferred = feed("deepspeed", [
        _ds(50, 0, "OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768"),
        _ds(50, 1, "OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 32768, reducing to 16384"),
        _ds(50, 9, "step=10, skipped=2, lr=[1e-05, 1e-05], mom=[(0.9, 0.95), (0.9, 0.95)]"),
    ])  # fmt: skip
    assert [s.step for s in steps] == list(range(1, 11))
    assert [(s.loss_scale, s.skipped) for s in steps[:3]] == [(65536.0, True), (32768.0, True),
                                                              (16384.0, False)]  # fmt: skip
    assert {s.loss_scale for s in steps[2:]} == {16384.0}
    assert steps[-1].lr == 1e-05 and all(s.lr is None for s in steps[:-1])
    assert "loss_scale" in inferred and "held" in inferred["loss_scale"]


def test_deepspeed_chat_sft_without_its_scaler_line_never_drifts() -> None:
    """The OPT-1.3B SFT log (healthy, 7,360 attempts, 139 skipped) as its users have it,
    without the `# scaler:` line the corpus adds: the old parser replayed DeepSpeed's default
    window (1000) and drifted to 1.0 from step 1020 (55 critical alerts); every stored scale
    is now a printed one (or held from one), so none is below the lowest printed: 2048."""
    text = (DATA / "real_logs/deepspeed-chat-sft-opt1.3b.log").read_bytes()
    lines = [(n, t) for n, t in iter_lines(text) if not t.startswith("#")]
    _, _, entries, reader = read_lines(lines, "auto")
    steps = steps_of(entries)
    printed = [float(t.split("Attempted loss scale: ")[1].split(",")[0]) for _, t in lines
               if "Attempted loss scale" in t]  # fmt: skip
    assert len(steps) == 7360 and sum(s.skipped for s in steps) == 139
    assert [s.loss_scale for s in steps if s.skipped] == printed
    assert min(s.loss_scale for s in steps if s.loss_scale is not None) == 2048.0
    assert "loss_scale" in reader.inferred


def test_one_step_line_does_not_make_a_burst_of_every_overflow() -> None:
    """Issue 31: two overflows at 06:51 and `step=510, skipped=2` at 06:59 became a burst at
    509-510. With the log's first time stamp (06:40, the engine starting) as the process
    start they are placed by time, ~1.3 s an attempt: far from 510, and named as inferred."""
    steps, inferred = feed("deepspeed", [
        _ds(40, 0, "DeepSpeed info: version=0.9.0"),
        _ds(51, 0, "OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, but hysteresis is 2"),
        _ds(51, 1, "OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768"),
        _ds(59, 0, "step=510, skipped=2, lr=[1e-05], mom=[(0.9, 0.95)]"),
    ])  # fmt: skip
    skipped = [s.step for s in steps if s.skipped]
    assert len(steps) == 510 and skipped == [295, 296]
    assert "first_overflows" in inferred
    # Without that first stamp the place is unknown: the overflows are put first, and said so.
    steps, inferred = feed("deepspeed", [
        _ds(51, 0, "OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768"),
        _ds(59, 0, "step=510, skipped=1, lr=[1e-05], mom=[(0.9, 0.95)]"),
    ])  # fmt: skip
    assert [s.step for s in steps if s.skipped] == [1] and "unplaced" in inferred


def test_deepspeed_reads_the_lowest_rank_when_every_rank_prints() -> None:
    """8 ranks interleaving their own OVERFLOW lines ("Rank r" in the text): only rank 0's
    are read; rank 3's fall to 4 is not rank 0's scale (the old parser counted every line)."""
    lines = []
    for minute, (a, b) in enumerate([(1024, 512), (512, 512)]):
        for rank in range(8):
            low = (a // 4, b // 4) if rank == 3 else (a, b)
            lines.append(_ds(minute, rank, f"OVERFLOW! Rank {rank} Skipping step. Attempted "
                                          f"loss scale: {low[0]}, reducing to {low[1]}"))  # fmt: skip
        lines.append(_ds(minute, 30, f"step={10 * (minute + 1)}, skipped={minute + 1}, lr=[1e-05]"))
    steps, _ = feed("deepspeed", lines)
    assert [s.loss_scale for s in steps if s.skipped] == [1024.0, 512.0]
    assert min(s.loss_scale for s in steps if s.loss_scale is not None) == 512.0


def test_fp16_optimizer_reduce_and_increase_lines_of_every_rank() -> None:
    """FP16_Optimizer prints "Grad overflow on iteration i", "Reducing/Increasing dynamic
    loss scale from X to Y" on every rank: one skip per iteration, at the printed X; the
    printed growth is the scale from there on."""
    lines = []
    for _rank in range(4):
        lines += [_ds(0, 1, "Grad overflow on iteration 4"),
                  _ds(0, 1, "Reducing dynamic loss scale from 1024.0 to 512.0")]  # fmt: skip
    lines.append(_ds(0, 10, "step=10, skipped=1, lr=[1e-05]"))
    for _rank in range(4):
        lines.append(_ds(0, 15, "Increasing dynamic loss scale from 512.0 to 1024.0"))
    lines.append(_ds(0, 20, "step=20, skipped=1, lr=[1e-05]"))
    steps, _ = feed("deepspeed", lines)
    assert [(s.step, s.loss_scale) for s in steps if s.skipped] == [(5, 1024.0)]
    assert steps[5].loss_scale == 512.0 and steps[-1].loss_scale == 1024.0
    assert min(s.loss_scale for s in steps if s.loss_scale is not None) == 512.0


# -- the tolerant reader ------------------------------------------------------------------

_MEGATRON = (" iteration {it:>8}/  100000 | consumed samples: {s:>8} | elapsed time per "
             "iteration (ms): 400.0 | learning rate: 6.000E-05 | global batch size:   512 | "
             "lm loss: 2.500000E+00 | loss scale: 4096.0 | grad norm: 0.500 | number of "
             "skipped iterations:   0 | number of nan iterations:   0 |")  # fmt: skip


def test_cut_undecodable_and_wrapped_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    """A banner byte that is not UTF-8, a line wrapped inside a number, and a last line
    cut after `learning` (a killed job) were each a refusal of the whole file (the cut one
    an empty step): now each is one line skipped, counted by reason, and the rest is read."""
    good = [_MEGATRON.format(it=i, s=i * 512) for i in range(1, 6)]
    wrapped = good[2][:150], good[2][150:]
    data = (b"> building GPT model \xff\xfe\n" + "\n".join([good[0], good[1], *wrapped, good[3]]).encode()
            + b"\n" + good[4].split("learning")[0].encode() + b"learning")  # fmt: skip
    lines = list(iter_lines(data))
    fmt, _, entries, reader = read_lines(lines, "auto")
    assert fmt == "megatron"
    assert [s.step for s in steps_of(entries)] == [1, 2, 4]
    assert reader.unread.counts == {"not UTF-8": 1, "cut": 2}
    assert reader.unread.lines["cut"] == [4, 7]
    assert "3 lines not read" in reader.unread.summary()


def test_megatron_nan_counter_is_a_nan_loss() -> None:
    """Megatron prints no lm loss when the loss is NaN (it logs only an average > 0): the
    nan-iterations counter makes that step's loss NaN, a value (not a gap)."""
    line = (" iteration      120/  100000 | consumed samples:        61440 | learning rate: "
            "6.000E-05 | global batch size:   512 | loss scale: 1.0 | grad norm: 0.500 | "
            "number of skipped iterations:   0 | number of nan iterations:   1 |")  # fmt: skip
    (step,), _ = feed("megatron", [line])
    assert step.loss is not None and math.isnan(step.loss)


def test_megatron_before_its_key_colon_style() -> None:
    """Megatron-LM's 2019 print (pretrain_gpt2.py: ' learning rate {:.3E} |', ' lm loss
    {:.6E} |', ' loss scale {:.1f} |'); lines built from that format string, no public
    excerpt of it was found."""
    lines = [f" iteration {it:>8}/  300000 | elapsed time per iteration (ms): 394.3 | learning "
             f"rate 1.500E-04 | lm loss {loss:.6E} | loss scale {scale:.1f} |"
             for it, loss, scale in ((100, 7.12, 65536.0), (200, 6.5, 32768.0))]  # fmt: skip
    assert detect_format(lines)[0] == "megatron"
    steps, _ = feed("megatron", lines)
    assert [(s.step, s.loss, s.loss_scale, s.lr) for s in steps] == [
        (100, 7.12, 65536.0, 1.5e-4), (200, 6.5, 32768.0, 1.5e-4)]  # fmt: skip


# -- new formats ----------------------------------------------------------------------------


def test_nanogpt_nan_loss_eval_line_and_checkpoint() -> None:
    fmt, why, entries, _ = read("log_formats/nanogpt-215-nan.log")
    assert fmt == "nanogpt" and "iter" in why
    steps = steps_of(entries)
    assert [s.step for s in steps] == list(range(2920, 3070, 10))
    assert steps[0].loss == 3.9883 and steps[8].loss == 4.2490
    assert [s.step for s in steps if s.loss is not None and math.isnan(s.loss)] == list(
        range(3010, 3070, 10))  # fmt: skip
    assert [(c.step, c.path) for c in entries if isinstance(c, Checkpoint)] == [(3000, "out")]


def test_nanogpt_after_launcher_lines() -> None:
    fmt, why, entries, _ = read("log_formats/nanogpt-110-healthy.log")
    assert fmt == "nanogpt" and "2 line(s) before it carry no marker" in why
    assert [s.loss for s in steps_of(entries)][:2] == [4.0863, 3.7441]


def test_xlm_iteration_loss_and_lr() -> None:
    fmt, _, entries, _ = read("log_formats/xlm-209-mlm.log")
    steps = steps_of(entries)
    assert fmt == "xlm" and [s.step for s in steps] == [1135, 1140, 1145, 1150]
    assert (steps[0].loss, steps[0].lr) == (7.7416, 3.8795e-06)


def test_dllogger_stdout_form() -> None:
    fmt, _, entries, _ = read("log_formats/dllogger-1107-bert-squad.log")
    steps = steps_of(entries)
    assert fmt == "dllogger" and [s.step for s in steps][:2] == [2872, 2922]
    assert steps[0].loss == 0.6953772306442261 and steps[0].lr == 1.5844598709048836e-05


def test_dllogger_json_records() -> None:
    """DLLogger's JSONStreamBackend ("DLLL " + json.dumps({timestamp, datetime,
    elapsedtime, type, step, data})): records built with that layout. Per-epoch
    iterations continue the count (named as inferred); summaries and PARAMETER records are
    not steps; a NaN loss is a value."""

    def record(step: object, data: dict[str, object], kind: str = "LOG") -> str:
        return "DLLL " + json.dumps({"timestamp": "1591234567.1", "datetime": "2020-06-04",
                                     "elapsedtime": "1.0", "type": kind, "step": step,
                                     "data": data})  # fmt: skip

    lines = [record("PARAMETER", {"batch_size": 8}), record([0, 1], {"loss": 2.5, "lr": 1e-3}),
             record([0, 2], {"loss": 2.4, "loss_scale": 65536.0}), record([0], {"loss": 2.45}),
             record([1, 1], {"loss": float("nan")}), record([], {"loss": 2.0})]  # fmt: skip
    assert detect_format(lines)[0] == "dllogger"
    steps, inferred = feed("dllogger", lines)
    assert [(s.step, s.loss_scale, s.lr) for s in steps] == [(1, None, 1e-3), (2, 65536.0, None),
                                                             (4, None, None)]  # fmt: skip
    assert steps[2].loss is not None and math.isnan(steps[2].loss) and "step" in inferred


def test_generic_key_value_lines() -> None:
    fmt, why, entries, _ = read("log_formats/generic-aws-45-bert-steps.log")
    steps = steps_of(entries)
    assert fmt == "generic" and "step number" in why
    assert [(s.step, s.loss) for s in steps][:2] == [(1040, 11.174), (1050, 11.174)]
    steps, _ = feed("generic", ["step 1 loss 2.5 lr 0.001", "Step 2 | loss: nan | grad_norm: 3.0",
                                "global_step=3, loss=2.4, loss_scale=512.0, overflow=True",
                                "step 4: train loss 2.3, val loss 2.9", "step 2 loss 2.6"])  # fmt: skip
    assert [(s.step, s.lr, s.grad_norm, s.loss_scale, s.skipped) for s in steps] == [
        (1, 0.001, None, None, False), (2, None, 3.0, None, False), (3, None, None, 512.0, True),
        (4, None, None, None, False), (2, None, None, None, False)]  # fmt: skip
    assert steps[1].loss is not None and math.isnan(steps[1].loss) and steps[3].loss == 2.3


def test_tqdm_postfix_bars() -> None:
    """tqdm's bar with a postfix (`set_postfix(loss=...)`), as tqdm draws it: redraws with
    \\r, the last drawing of a counter wins; a second bar continues the count."""
    bar = " {p}%|#  | {n}/100 [00:{n:02d}<00:10,  5.00it/s, loss={loss}, lr=0.001]"
    lines = ["\r".join(bar.format(p=n, n=n, loss=loss) for n, loss in
                       ((1, "2.50"), (2, "2.40"), (2, "2.45"), (3, "nan"))),
             bar.format(p=1, n=1, loss="2.30")]  # fmt: skip
    assert detect_format(lines)[0] == "tqdm"
    steps, inferred = feed("tqdm", lines)
    assert [(s.step, s.lr) for s in steps] == [(1, 0.001), (2, 0.001), (3, 0.001), (101, 0.001)]
    assert steps[1].loss == 2.45 and steps[2].loss is not None and math.isnan(steps[2].loss)
    assert "step" in inferred


def test_auto_detection_looks_past_launcher_noise() -> None:
    """6,000 NCCL lines before the first Megatron line: the old detector gave up after
    5,000 lines; the reason says how many lines came before the marker."""
    noise = [f"node1:123:456 [0] NCCL INFO Channel {i % 32:02d} : 0[0] -> 1[1] via P2P/IPC"
             for i in range(6000)]  # fmt: skip
    lines = noise + [_MEGATRON.format(it=i, s=i) for i in range(1, 4)]
    fmt, why = detect_format(lines)
    assert fmt == "megatron" and "6000 line(s) before it carry no marker" in why
    with pytest.raises(ValueError, match="no line of the 6000 read"):
        detect_format(noise)


def test_findings_name_unread_lines_and_inferences() -> None:
    from ampwatch.agent.logs.importer import ParsedLog, plan_runs

    fmt, why, entries, reader = read("log_formats/apex-318-tiny-scale.log")
    reader.unread.add(3, "cut")
    log = ParsedLog("x.log", fmt, why, entries, "d", reader.unread, dict(reader.inferred))
    (run,) = plan_runs([log])
    notes = [e for _, _, p in run.processes for e in p if isinstance(e, Finding)]
    assert [n.data["code"] for n in notes] == ["log_lines_unread", "log_values_inferred"]
    assert notes[0].data["count"] == 1 and "step" in notes[1].data["inferred"]
    assert not any(isinstance(e, Restart) for e in entries)
