"""The spool and offline file: formats, the size bound, replay order, bearer tokens, and a
queue that stays bounded and cheap however stuck the collector is."""

from __future__ import annotations

import gzip
import json
import logging
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from agent_fakes import FakeClock, FakeCollector, layer_sample, step_sample

from ampwatch.agent import wire
from ampwatch.agent.delivery import DeliveryOptions
from ampwatch.agent.spool import (
    SEGMENT_SUFFIX,
    Frame,
    Spool,
    decode_frame,
    default_spool_dir,
    encode_frame,
    read_frames,
)
from ampwatch.agent.transport import Sender

RUN: wire.RunRef = {"client_run_id": "c0ffee", "name": "t", "project": "default"}
KINDS = wire.DROPPED_KINDS


def _frame(seq: int, steps: int = 2, layers: int = 2, names: int = 50, events: int = 0) -> Frame:
    batch = {
        "wire_version": wire.WIRE_VERSION,
        "run": RUN,
        "seq": seq,
        "steps": [{"step": seq * 10 + i} for i in range(steps)],
        "layer_stats": [
            {
                "step": seq * 10,
                "names": [f"l{j}" for j in range(names)],
                "stats": {"zero_fraction": [j / 7 for j in range(names)]},
            }
            for _ in range(layers)
        ],
        "events": [{"kind": "checkpoint", "step": seq, "time": 0.0, "data": {}}] * events,
        "dropped": dict.fromkeys(KINDS, 0),
    }
    body = gzip.compress(json.dumps(batch).encode())
    records = {"steps": steps, "layer_stats": layers, "events": events}
    return Frame(seq, body, records, dict.fromkeys(KINDS, 0))


def _batches(spool: Spool) -> list[dict[str, Any]]:
    out = []
    while (frame := spool.peek()) is not None:
        out.append(json.loads(gzip.decompress(frame.body)))
        spool.pop()
    return out


# --- format ------------------------------------------------------------------------------


def test_a_torn_last_line_is_skipped_not_misread(tmp_path: Path) -> None:
    path = tmp_path / "run.ampwatch"
    whole = [_frame(0).body, _frame(1).body]
    torn = encode_frame(_frame(2).body)[:-40]  # the process died mid-write
    path.write_bytes(b"".join(encode_frame(b) for b in whole) + torn)
    assert list(read_frames(path)) == [*whole, None]
    assert decode_frame(b"not base64 at all!") is None


def test_default_spool_dir_is_per_run_under_the_env_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AMPWATCH_SPOOL_DIR", str(tmp_path))
    assert default_spool_dir("abc") == tmp_path / "abc"
    monkeypatch.delenv("AMPWATCH_SPOOL_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_spool_dir("abc") == tmp_path / "cache" / "ampwatch" / "spool" / "abc"


# --- Spool -------------------------------------------------------------------------------


def test_frames_come_back_in_order_and_acknowledged_segments_are_deleted(
    tmp_path: Path,
) -> None:
    spool = Spool(tmp_path, max_bytes=10**9, segment_bytes=2000)
    for seq in range(10):
        spool.append(_frame(seq))
    assert len(list(tmp_path.glob(f"*{SEGMENT_SUFFIX}"))) > 1
    assert [b["seq"] for b in _batches(spool)] == list(range(10))
    assert list(tmp_path.iterdir()) == [] and spool.nbytes == 0 and len(spool) == 0


def test_the_bound_empties_the_oldest_layer_stats_first_and_says_so_in_dropped(
    tmp_path: Path,
) -> None:
    sizes = len(encode_frame(_frame(0).body))
    spool = Spool(tmp_path, max_bytes=20 * sizes, segment_bytes=3 * sizes)
    emptied_total = dict.fromkeys(KINDS, 0)
    for seq in range(30):
        emptied, lost = spool.append(_frame(seq))
        assert lost == {}
        for kind, n in emptied.items():
            emptied_total[kind] += n
        assert spool.nbytes <= spool.max_bytes
        on_disk = sum(p.stat().st_size for p in tmp_path.glob(f"*{SEGMENT_SUFFIX}"))
        assert on_disk == spool.nbytes
    batches = _batches(spool)
    assert [b["seq"] for b in batches] == list(range(30))
    assert all(len(b["steps"]) == 2 for b in batches)  # never a step while stats remain
    stripped = [not b["layer_stats"] for b in batches]
    assert stripped == sorted(stripped, reverse=True)  # oldest first
    assert sum(b["dropped"]["layer_stats"] for b in batches) == emptied_total["layer_stats"]
    assert emptied_total["layer_stats"] == 2 * sum(stripped) > 0
    assert emptied_total["steps"] == 0


def test_only_empty_batches_left_then_the_oldest_segments_go_and_are_counted(
    tmp_path: Path,
) -> None:
    frames = [_frame(seq, steps=50, layers=0, names=0) for seq in range(40)]
    size = len(encode_frame(frames[0].body))
    spool = Spool(tmp_path, max_bytes=4 * size, segment_bytes=size)
    emptied_total, lost_total = dict.fromkeys(KINDS, 0), dict.fromkeys(KINDS, 0)
    for frame in frames:
        emptied, lost = spool.append(frame)
        for kind in KINDS:
            emptied_total[kind] += emptied.get(kind, 0)
            lost_total[kind] += lost.get(kind, 0)
        assert spool.nbytes <= spool.max_bytes
    batches = _batches(spool)
    delivered = sum(len(b["steps"]) for b in batches)
    in_dropped = sum(b["dropped"]["steps"] for b in batches)
    # every step is delivered, counted in a delivered batch, or reported as lost
    assert delivered + in_dropped + lost_total["steps"] == 40 * 50
    assert emptied_total["steps"] > 0 and lost_total["steps"] > 0


def test_a_spool_too_small_for_the_outage_keeps_the_newest_batch_and_every_event_it_can(
    tmp_path: Path,
) -> None:
    """Seen in CI: a spool a few batches deep emptied the newest batch of its steps and
    events (the run-end event with them) before deleting segments of batches that held only
    counts, and the run never ended on the server. Now events are never emptied, batches
    holding only counts go first, and older segments go whole before the newest batch
    loses a step."""
    size = len(encode_frame(_frame(0, steps=10, layers=10, names=40).body))
    spool = Spool(tmp_path, max_bytes=9 * size, segment_bytes=4 * size)
    lost_total = dict.fromkeys(KINDS, 0)
    for seq in range(200):
        emptied, lost = spool.append(_frame(seq, steps=10, layers=10, names=40, events=1))
        assert "events" not in emptied
        for kind in KINDS:
            lost_total[kind] += lost.get(kind, 0)
        assert spool.nbytes <= spool.max_bytes
        newest = spool._segments[-1].entries[-1]
        assert (newest.seq, newest.records["steps"], newest.records["events"]) == (seq, 10, 1)
    assert lost_total["events"] > 0  # the bound did delete whole segments
    batches = _batches(spool)
    assert all(len(b["events"]) == 1 for b in batches)
    assert len(batches) + lost_total["events"] == 200
    for kind in ("steps", "layer_stats"):  # each record delivered, counted or lost, once
        delivered = sum(len(b[kind]) for b in batches)
        in_dropped = sum(b["dropped"][kind] for b in batches)
        assert delivered + in_dropped + lost_total[kind] == 200 * 10, kind


# --- Sender: outage, spool, replay -------------------------------------------------------


class Switchable(FakeCollector):
    """A collector that is down (connection refused) until `up` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.up = threading.Event()

    def __call__(self, body: bytes, headers: dict[str, str]) -> int:
        if not self.up.is_set():
            self.attempts += 1
            raise ConnectionRefusedError("nothing listens")
        return super().__call__(body, headers)


def test_an_outage_spools_to_disk_then_replays_in_order_once(tmp_path: Path) -> None:
    clock = FakeClock()
    collector = Switchable()
    options = clock.options(spool_dir=tmp_path, retry_base=0.005, retry_cap=0.05, spool_after=2)
    sender = Sender(RUN, collector, flush_interval=0.01, delivery=options)
    for step in range(1, 201):
        sender.put(step_sample(step))
        if step % 20 == 1:
            sender.put(layer_sample(step))
        if step % 50 == 0:  # a flush interval and a retry delay later: seal, try, spool
            clock.sleep(0.05)
            sender.tick()
    assert sender.counters()["batches_spooled"] >= 3
    assert list(tmp_path.glob(f"*{SEGMENT_SUFFIX}"))
    collector.up.set()
    assert sender.close(timeout=10)

    seqs = [b["seq"] for b in collector.batches]
    assert seqs == list(range(len(seqs)))
    assert [r["step"] for r in collector.steps()] == list(range(1, 201))
    assert [r["step"] for r in collector.layer_stats()] == list(range(1, 201, 20))
    assert list(tmp_path.glob(f"*{SEGMENT_SUFFIX}")) == []
    counters = sender.counters()
    assert counters["batches_sent"] == len(seqs) and counters["spooled_at_close"] == 0


def test_a_full_spool_drops_layer_stats_and_the_counts_reach_the_collector(
    tmp_path: Path,
) -> None:
    collector = Switchable()
    # one batch per 25 steps: no timed flush (the clock stands still); a tick seals when
    # 50 records are buffered
    options = FakeClock().options(
        spool_dir=tmp_path,
        spool_max_bytes=12_000,
        max_batch_records=50,
        retry_base=0.005,
        retry_cap=0.05,
        spool_after=1,
    )
    sender = Sender(RUN, collector, flush_interval=60.0, max_queue=200, delivery=options)
    names = tuple(f"blocks.{i}.weight" for i in range(40))
    for step in range(1, 301):
        sender.put(step_sample(step))
        sender.put(layer_sample(step, names))
        if step % 25 == 0:
            sender.tick()
    assert sender.counters()["batches_spooled"] == 12
    assert sender.counters()["dropped_layer_stats"] > 0
    assert sum(p.stat().st_size for p in tmp_path.glob("*.spool")) <= 12_000
    collector.up.set()
    assert sender.close(timeout=10)

    counters = sender.counters()
    reported = {k: sum(b["dropped"][k] for b in collector.batches) for k in KINDS}
    assert reported["layer_stats"] == counters["dropped_layer_stats"] > 0
    assert len(collector.layer_stats()) + reported["layer_stats"] == 300
    assert len(collector.steps()) + reported["steps"] == 300
    assert reported["steps"] == counters["dropped_steps"]
    # the newest layer statistics survive; the oldest were dropped
    assert collector.layer_stats()[-1]["step"] == 300


def test_close_with_the_collector_down_leaves_the_batches_in_the_spool(
    tmp_path: Path,
) -> None:
    sender = Sender(
        RUN, Switchable(), delivery=DeliveryOptions(spool_dir=tmp_path, retry_base=0.01)
    )
    sender.start()
    for step in range(1, 6):
        sender.put(step_sample(step))
    assert sender.close(timeout=0.5) is False
    counters = sender.counters()
    assert counters["spooled_at_close"] >= 1 and counters["unsent_at_close"] == 0
    spooled = [
        json.loads(gzip.decompress(b))
        for p in tmp_path.glob("*.spool")
        for b in read_frames(p)
        if b is not None
    ]
    assert [r["step"] for b in spooled for r in b["steps"]] == [1, 2, 3, 4, 5]


# --- offline, token ----------------------------------------------------------------------


def test_offline_mode_writes_only_to_its_file(tmp_path: Path) -> None:
    def no_network(body: bytes, headers: dict[str, str]) -> int:
        raise AssertionError("offline mode must not send")

    path = tmp_path / "out" / "run.ampwatch"
    clock = FakeClock()
    sender = Sender(
        RUN, no_network, offline_file=path, flush_interval=0.01, delivery=clock.options()
    )
    sender.put(step_sample(1))
    clock.sleep(0.01)
    sender.tick()  # the flush interval has passed: batch 0 is written
    sender.put(step_sample(2))
    sender.put({"kind": "run_end", "step": 2, "time": 0.0, "data": {}})
    assert sender.close(timeout=5)
    batches = [json.loads(gzip.decompress(b)) for b in read_frames(path) if b is not None]
    assert [b["seq"] for b in batches] == list(range(len(batches))) and len(batches) >= 2
    assert [r["step"] for b in batches for r in b["steps"]] == [1, 2]
    assert not (tmp_path / "spool").exists()


def test_a_token_is_sent_as_a_bearer_header() -> None:
    collector = FakeCollector()
    sender = Sender(RUN, collector, token="aw_1234_secret")
    sender.start()
    sender.put(step_sample(1))
    assert sender.close(timeout=5)
    assert collector.headers[0]["Authorization"] == "Bearer aw_1234_secret"
    unauthenticated = FakeCollector()
    sender = Sender(RUN, unauthenticated)
    sender.start()
    sender.put(step_sample(1))
    assert sender.close(timeout=5)
    assert "Authorization" not in unauthenticated.headers[0]


def test_a_refused_token_is_logged_once_counted_and_not_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    collector = FakeCollector(statuses=[401] * 100)
    sender = Sender(RUN, collector, token="wrong", flush_interval=0.01, delivery=clock.options())
    with caplog.at_level(logging.WARNING, logger="ampwatch.agent"):
        for step in range(1, 4):
            sender.put(step_sample(step))
            clock.sleep(0.01)
            sender.tick()
        sender.close(timeout=2)
    counters = sender.counters()
    assert counters["auth_failures"] == collector.attempts >= 2
    assert counters["dropped_steps"] == 3
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "token" in caplog.records[0].message and len(caplog.records) == 1


# --- the training thread's side: never blocked, memory bounded ---------------------------


def test_a_hung_collector_keeps_put_cheap_and_the_queue_bounded() -> None:
    entered, release = threading.Event(), threading.Event()

    def hung(body: bytes, headers: dict[str, str]) -> int:
        entered.set()
        release.wait(30)
        return 200

    sender = Sender(
        RUN, hung, max_queue=1000, flush_interval=0.001, delivery=DeliveryOptions(spool=False)
    )
    sender.start()
    sender.put(step_sample(0))
    assert entered.wait(5)  # the sender thread is now stuck inside the first send
    samples = [step_sample(step) for step in range(1, 20_001)]
    layers = layer_sample(1)
    costs = []
    for step, sample in enumerate(samples, 1):
        started = time.perf_counter()
        sender.put(sample)
        if step % 10 == 0:
            sender.put(layers)
        costs.append(time.perf_counter() - started)
    queued = len(sender._queue)
    release.set()
    sender.close(timeout=5)
    assert queued <= 1000
    assert statistics.median(costs) < 50e-6  # ~1 µs here; generous for a noisy machine
    counters = sender.counters()
    # the first 1000 samples filled the queue; then steps evicted its layer samples, and
    # a step or layer sample finding no layer sample to evict was dropped itself
    assert counters["dropped_layer_stats"] == 2000
    assert counters["dropped_steps"] == 20_000 - 1000


def test_a_full_queue_evicts_the_oldest_layer_sample_before_any_step() -> None:
    collector = FakeCollector()
    sender = Sender(RUN, collector, max_queue=3)
    sender.put(layer_sample(1))
    sender.put(layer_sample(2))
    sender.put(step_sample(1))
    sender.put(step_sample(2))  # evicts layer sample 1
    sender.put(step_sample(3))  # evicts layer sample 2
    sender.put(step_sample(4))  # nothing to evict: dropped
    sender.start()
    assert sender.close(timeout=5)
    assert [r["step"] for r in collector.steps()] == [1, 2, 3]
    assert collector.layer_stats() == []
    assert collector.batches[0]["dropped"] == {"steps": 1, "layer_stats": 2, "events": 0}


def test_a_second_spool_in_the_same_directory_never_appends_to_the_first(
    tmp_path: Path,
) -> None:
    crashed = Spool(tmp_path, max_bytes=10**9)
    crashed.append(_frame(0))
    resumed = Spool(tmp_path, max_bytes=10**9)  # a resumed run: same directory, seq 0 again
    resumed.append(_frame(0, steps=5))
    assert len(list(tmp_path.glob(f"*{SEGMENT_SUFFIX}"))) == 2
    assert [len(b["steps"]) for b in _batches(resumed)] == [5]
    assert [len(b["steps"]) for b in _batches(crashed)] == [2]


def test_a_spool_deleted_under_the_sender_costs_its_records_not_the_sender(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    collector = Switchable()
    options = clock.options(spool_dir=tmp_path, retry_base=0.005, retry_cap=0.02, spool_after=1)
    sender = Sender(RUN, collector, flush_interval=0.01, delivery=options)
    sender.put(step_sample(1))
    clock.sleep(0.01)
    sender.tick()  # sealed, refused once, spooled
    assert sender.counters()["batches_spooled"] >= 1
    for segment in tmp_path.glob(f"*{SEGMENT_SUFFIX}"):
        segment.unlink()  # e.g. a cache cleaner
    collector.up.set()
    sender.put(step_sample(2))
    assert sender.close(timeout=5)
    # step 1 is lost, unless a retry had already read it back before the deletion
    delivered = [r["step"] for r in collector.steps()]
    dropped = sum(b["dropped"]["steps"] for b in collector.batches)
    assert (delivered, dropped) in (([2], 1), ([1, 2], 0))


def test_a_run_id_cannot_lead_the_spool_outside_its_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AMPWATCH_SPOOL_DIR", str(tmp_path / "root"))
    root = (tmp_path / "root").resolve()
    for run_id in ("../../etc", "..", ".", "a/../../b", "/abs", "x" * 600, "a\\..\\b", "ok-1.2"):
        folder = default_spool_dir(run_id)
        assert folder.parent == tmp_path / "root", run_id
        assert folder.resolve().parent == root and len(folder.name) <= 200, run_id
    assert default_spool_dir("ok-1.2").name == "ok-1.2"  # plain ids are kept as they are
    assert default_spool_dir("a/b") != default_spool_dir("a%2Fb")  # quoting is one-to-one


def test_segments_of_a_killed_process_are_adopted_once_and_a_live_ones_never(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    live = Spool(tmp_path, max_bytes=10**9)
    live.append(_frame(7))  # a live process (another rank) of the same run
    # A process spools three batches and is SIGKILLed (no atexit, no cleanup).
    script = (
        "import gzip, json, os, signal, sys; from pathlib import Path\n"
        "from ampwatch.agent.spool import Frame, Spool\n"
        "spool = Spool(Path(sys.argv[1]), max_bytes=10**9)\n"
        "for seq in range(3):\n"
        "    body = gzip.compress(json.dumps({'seq': seq, 'steps': [{}], 'layer_stats': [],"
        " 'events': [], 'dropped': {}}).encode())\n"
        "    spool.append(Frame(seq, body, {'steps': 1, 'layer_stats': 0, 'events': 0}, {}))\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=False)
    assert done.returncode == -9

    resumed = Spool(tmp_path, max_bytes=10**9)
    assert len(resumed) == 3  # the killed one's, not the live one's
    again = Spool(tmp_path, max_bytes=10**9)
    assert len(again) == 0  # adopted by `resumed`, which lives: never twice
    resumed.append(_frame(3, steps=4))
    assert [b["seq"] for b in _batches(resumed)] == [0, 1, 2, 3]
    assert [b["seq"] for b in _batches(live)] == [7]
    assert list(tmp_path.glob(f"*{SEGMENT_SUFFIX}")) == []
