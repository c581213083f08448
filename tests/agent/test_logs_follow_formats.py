"""`ampwatch follow` streams every format as the log grows (issue 31): each step reaches the
transport while the log is still being written, DeepSpeed's engine lines included (the old
follower stored nothing of them until Ctrl-C), with a p95 latency under 2 s from the write.

In process: the follower's own `Sender` threads with an in-memory transport (the agent's
`transport=` seam), `tick()` driven by the test, as `ampwatch follow`'s loop drives it.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ampwatch.agent.logs import Target
from ampwatch.agent.logs.follow import Follower

_STAMP = "[2024-01-01 00:{m:02d}:{s:02d},000] [INFO] [logging.py:96:log_dist] [Rank 0] "


def _ds(k: int) -> str:
    stamp = _STAMP.format(m=k // 6, s=(k % 6) * 10)
    over = (f"{stamp}OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to "
            "32768\n" if k % 3 == 0 else "")  # fmt: skip
    return (
        over
        + _STAMP.format(m=k // 6, s=(k % 6) * 10 + 5)
        + f"step={10 * k}, skipped={k // 3 + 1}, lr=[1e-05]\n"
    )


#: format -> the lines of its k-th logged step (k from 1).
UNITS: dict[str, Callable[[int], str]] = {
    "megatron": lambda k: (f" iteration {k:>8}/  100000 | consumed samples: {512 * k:>10} | "
                           "learning rate: 6.000E-05 | lm loss: 2.500000E+00 | loss scale: "
                           "4096.0 | grad norm: 0.500 | number of skipped iterations:   0 | "
                           "number of nan iterations:   0 |\n"),
    "deepspeed": _ds,
    "fairseq": lambda k: (f"2021-01-01 00:00:00 | INFO | train_inner | epoch 001:  {k} / 1000 "
                          f"loss=2.5, loss_scale=4, gnorm=0.5, num_updates={k}, lr=0.0001\n"),
    "hf": lambda k: f" {k}%|#   | {k}/100 [00:{k:02d}<00:10,  1.00it/s]\n",
    "apex": lambda k: ("Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to "
                       f"{2.0 ** (20 - k)}\n"),
    "nanogpt": lambda k: f"iter {k}: loss 3.5, time 500.00ms, mfu 15.00%\n",
    "dllogger": lambda k: ('DLLL {"timestamp": "1.0", "datetime": "2020", "elapsedtime": "1.0",'
                           f' "type": "LOG", "step": [0, {k}], "data": {{"loss": 2.5}}}}\n'),
    "xlm": lambda k: (f"INFO - 10/04/19 14:41:25 - 0:11:11 - {k:>7} -   56.12 sent/s -  2143.80 "
                      "words/s - MLM-en:  7.7416 -  - model LR: 3.8795e-06\n"),
    "tqdm": lambda k: f" {k}%|#  | {k}/100 [00:{k:02d}<00:10,  5.00it/s, loss=2.5, lr=0.001]\n",
    "generic": lambda k: f"step {k} loss 2.5 lr 0.001\n",
    "llmc": lambda k: f"s:{k} trl:3.500000 lr:0.000600 norm:0.50\n",
    "olmo": lambda k: (f"2024-08-06 09:59:26.181 host:0  olmo.train:908  INFO    [step={k}/1000,"
                      "epoch=0]\n    optim/total_grad_norm=0.5\n    train/CrossEntropyLoss=2.5\n"),
    "mmdet": lambda k: (f"2023-06-15 04:03:40,870 - mmdet - INFO - Epoch [1][{k}/1000]\tlr: "
                        "1.000e-04, eta: 1:00:00, time: 0.500, loss_cls: 0.5, loss: 2.5\n"),
}  # fmt: skip


class _Transport:
    """Records when each batch's steps arrived."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps = 0
        self.events: list[dict[str, object]] = []

    def __call__(self, body: bytes, headers: dict[str, str]) -> int:
        batch = json.loads(gzip.decompress(body))
        with self.lock:
            self.steps += len(batch["steps"])
            self.events += batch["events"]
        return 200


def _wait(condition: Callable[[], bool], follower: Follower, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        follower.tick()
        time.sleep(0.005)
    return True


@pytest.mark.parametrize("fmt", list(UNITS))
def test_follow_streams_every_format_within_two_seconds(fmt: str, tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    unit = UNITS[fmt]
    warm = 12  # enough lines for --format auto to decide (a generic log: 10 lines)
    log.write_text("".join(unit(k) for k in range(1, warm + 1)))
    transport = _Transport()
    follower = Follower(log, Target("http://unused"), transport=transport,
                        spool_dir=tmp_path / "spool", flush_interval=0.02, log=lambda _: None)  # fmt: skip
    try:
        assert _wait(lambda: transport.steps > 0, follower, 10), "nothing streamed"
        assert follower.format == fmt
        latencies = []
        for k in range(warm + 1, warm + 16):
            before = transport.steps
            with log.open("a") as out:
                out.write(unit(k))
            written = time.monotonic()
            assert _wait(lambda: transport.steps > before, follower, 10), (fmt, k)  # noqa: B023
            latencies.append(time.monotonic() - written)
    finally:
        follower.close(timeout=5)
    latencies.sort()
    p95 = latencies[int(0.95 * (len(latencies) - 1))]
    assert p95 < 2.0, (fmt, latencies)
