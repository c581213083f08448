"""The sender: retry policy, sequence numbers, bounded memory, and never hurting training."""

from __future__ import annotations

import gzip
import http.server
import json
import socket
import threading
import time
from typing import Any

import pytest
import torch
from agent_fakes import FakeClock, FakeCollector, layer_sample, step_sample, wait_for
from torch import nn

from ampwatch.agent import watch, wire
from ampwatch.agent.delivery import DeliveryOptions
from ampwatch.agent.retry import retry_delay
from ampwatch.agent.transport import Sender

RUN: wire.RunRef = {"client_run_id": "c0ffee", "name": "t", "project": "default"}


# --- retry policy (pure) -----------------------------------------------------------------


@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422])
def test_client_errors_are_not_retried(status: int) -> None:
    assert retry_delay(1, status) is None


@pytest.mark.parametrize("status", [None, 429, 500, 502, 503])
def test_connection_errors_429_and_5xx_are_retried(status: int | None) -> None:
    assert retry_delay(1, status) is not None


def test_delay_doubles_with_jitter_between_half_and_full_ceiling() -> None:
    low = [retry_delay(n, 503, base=0.5, cap=1e9, rng=lambda: 0.0) for n in range(1, 6)]
    high = [retry_delay(n, 503, base=0.5, cap=1e9, rng=lambda: 1.0) for n in range(1, 6)]
    assert low == [0.25, 0.5, 1.0, 2.0, 4.0]
    assert high == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert retry_delay(3, None, base=0.5, cap=1e9, rng=lambda: 0.5) == pytest.approx(1.5)


def test_delay_is_capped() -> None:
    assert retry_delay(60, 500, base=0.5, cap=30.0, rng=lambda: 1.0) == 30.0
    assert retry_delay(60, 500, base=0.5, cap=30.0, rng=lambda: 0.0) == 15.0


# --- Sender ------------------------------------------------------------------------------


def test_a_batch_keeps_its_seq_across_retries() -> None:
    clock = FakeClock()
    collector = FakeCollector(statuses=[503, 500, 200])
    sender = Sender(RUN, collector, flush_interval=0.01, delivery=clock.options(retry_base=0.001))
    sender.put(step_sample(1))
    for _ in range(3):  # the flush interval seals seq 0; each tick tries it once
        clock.sleep(0.01)
        sender.tick()
    sender.put(step_sample(2))
    assert sender.close(timeout=5)

    assert [b["seq"] for b in collector.batches] == [0, 1]
    assert [r["step"] for b in collector.batches for r in b["steps"]] == [1, 2]
    counters = sender.counters()
    assert counters["send_failures"] == 2 and counters["batches_sent"] == 2


def test_a_rejected_batch_is_counted_as_dropped_in_the_next_one() -> None:
    clock = FakeClock()
    collector = FakeCollector(statuses=[422])
    sender = Sender(RUN, collector, flush_interval=0.01, delivery=clock.options())
    sender.put(step_sample(1))
    sender.put(layer_sample(1))
    for _ in range(2):  # seq 0 is rejected; a flush interval later seq 1 reports it
        clock.sleep(0.01)
        sender.tick()
    sender.put(step_sample(2))
    assert sender.close(timeout=5)

    # seq 0 was rejected and is never reused (later batches may hold 1.. already); the
    # next batch, sent without waiting for new data, says what was lost
    first, *rest = collector.batches
    assert first["seq"] == 1 and first["steps"] == [] and first["layer_stats"] == []
    assert first["dropped"] == {"steps": 1, "layer_stats": 1, "events": 0}
    assert [b["seq"] for b in rest] == [2]
    assert [r["step"] for r in rest[0]["steps"]] == [2]
    assert sender.counters()["batches_rejected"] == 1


def test_buffer_bound_drops_oldest_layer_stats_first() -> None:
    collector = FakeCollector()
    sender = Sender(RUN, collector, flush_interval=60.0, delivery=DeliveryOptions(max_buffered=10))
    for step in range(1, 5):
        sender.put(layer_sample(step))
    for step in range(1, 11):
        sender.put(step_sample(step))
    sender.put(step_sample(11))  # now over the bound with no layer stats left: oldest step goes
    sender.start()
    assert sender.close(timeout=5)

    (batch,) = collector.batches
    assert batch["layer_stats"] == []
    assert [r["step"] for r in batch["steps"]] == list(range(2, 12))
    assert batch["dropped"] == {"steps": 1, "layer_stats": 4, "events": 0}
    counters = sender.counters()
    assert counters["dropped_layer_stats"] == 4 and counters["dropped_steps"] == 1


def test_layer_stats_have_their_own_smaller_bound() -> None:
    collector = FakeCollector()
    options = DeliveryOptions(max_buffered_layer_stats=3)
    sender = Sender(RUN, collector, flush_interval=60.0, delivery=options)
    for step in range(1, 6):
        sender.put(layer_sample(step))
    sender.start()
    assert sender.close(timeout=5)
    assert [r["step"] for r in collector.layer_stats()] == [3, 4, 5]
    assert collector.batches[0]["dropped"]["layer_stats"] == 2


def test_a_full_queue_drops_and_counts_without_blocking() -> None:
    sender = Sender(RUN, FakeCollector(), max_queue=2)
    started = time.perf_counter()
    for step in range(5):
        sender.put(step_sample(step))
    assert time.perf_counter() - started < 0.1
    assert sender.counters()["dropped_steps"] == 3


def test_close_gives_up_at_its_deadline_and_counts_what_was_unsent() -> None:
    def down(body: bytes, headers: dict[str, str]) -> int:
        raise ConnectionRefusedError

    sender = Sender(RUN, down, delivery=DeliveryOptions(retry_base=0.05, spool=False))
    sender.put(step_sample(1))
    sender.start()
    started = time.perf_counter()
    assert sender.close(timeout=0.5) is False
    assert time.perf_counter() - started < 2.0
    assert sender.counters()["unsent_at_close"] == 1


# --- through watch(): the training loop never notices ------------------------------------


def _train(handle_steps: int, **watch_kwargs: Any) -> tuple[Any, float]:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    handle = watch(model, optimizer, scaler, flush_interval=0.01, **watch_kwargs)
    started = time.perf_counter()
    for _ in range(handle_steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8)).float().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return handle, time.perf_counter() - started


@pytest.mark.parametrize("failure", ["raises", "http_500"])
def test_a_failing_collector_never_reaches_the_training_loop(failure: str) -> None:
    def transport(body: bytes, headers: dict[str, str]) -> int:
        if failure == "raises":
            raise RuntimeError("collector on fire")
        return 500

    handle, _ = _train(30, transport=transport)
    wait_for(lambda: handle.counters["send_failures"] >= 1)
    handle.detach(timeout=0.3)
    counters = handle.counters
    assert handle.step == 30
    assert counters["send_failures"] >= 1 and counters["batches_sent"] == 0
    assert counters["hook_errors"] == 0


def test_a_blocked_sender_does_not_block_the_training_loop() -> None:
    entered, release = threading.Event(), threading.Event()
    collector = FakeCollector()

    def slow(body: bytes, headers: dict[str, str]) -> int:
        entered.set()
        release.wait(10)
        return collector(body, headers)

    handle, elapsed = _train(30, transport=slow)
    assert entered.wait(10)  # the sender is now stuck inside the first send
    assert not release.is_set() and elapsed < 5.0
    release.set()
    handle.detach(timeout=5)
    assert [r["step"] for r in collector.steps()] == list(range(1, 31))
    assert [b["seq"] for b in collector.batches] == list(range(len(collector.batches)))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_collector_costs_nothing_visible() -> None:
    handle, elapsed = _train(20, url=f"http://127.0.0.1:{_closed_port()}")
    started = time.perf_counter()
    handle.detach(timeout=0.5)
    assert time.perf_counter() - started < 3.0
    assert handle.step == 20 and elapsed < 5.0
    assert handle.counters["send_failures"] >= 1


def test_real_http_round_trip_sends_a_valid_gzip_batch() -> None:
    received: list[tuple[dict[str, str], dict[str, Any]]] = []
    paths: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            paths.append(self.path)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((dict(self.headers), json.loads(gzip.decompress(body))))
            reply = json.dumps({"duplicate": False}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        handle, _ = _train(5, url=f"http://127.0.0.1:{server.server_address[1]}/")
        handle.detach(timeout=5)
    finally:
        server.shutdown()
        server.server_close()

    assert received, "no batch arrived"
    headers, _ = received[0]
    # the URL's trailing slash is not doubled: every batch went to the ingest route
    assert set(paths) == {wire.INGEST_PATH} and len(paths) == len(received)
    assert headers["Content-Type"] == "application/json"
    assert headers["Content-Encoding"] == "gzip"
    for _, batch in received:
        assert set(batch) == set(wire.Batch.__annotations__)
        assert batch["wire_version"] == wire.WIRE_VERSION
        assert batch["run"]["client_run_id"] == handle.client_run_id
        for record in batch["steps"]:
            assert set(record) == wire.StepRecord.__required_keys__  # one param group
    assert [b["seq"] for _, b in received] == list(range(len(received)))
    (stream,) = {b["stream"] for _, b in received}  # one sender, one stream, for good
    assert len(stream) == 32 and int(stream, 16) >= 0
    steps = [r["step"] for _, b in received for r in b["steps"]]
    assert steps == [1, 2, 3, 4, 5]
    kinds = [e["kind"] for _, b in received for e in b["events"]]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end"
    assert handle.counters["batches_sent"] == len(received)


# --- delivery options ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"spool_after": 0},
        {"spool_max_bytes": 0},
        {"max_buffered": 0},
        {"max_batch_records": 1.5},
        {"retry_base": 0.0},
        {"retry_cap": -1.0},
    ],
)
def test_delivery_options_refuse_bounds_that_cannot_work(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="DeliveryOptions"):
        DeliveryOptions(**options)


def test_watch_takes_delivery_options_and_refuses_anything_else(tmp_path: Any) -> None:
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="DeliveryOptions"):
        watch(model, optimizer, transport=FakeCollector(), delivery={"retry_cap": 1.0})  # type: ignore[arg-type]

    def down(body: bytes, headers: dict[str, str]) -> int:
        raise ConnectionRefusedError

    # spool_after=1: the first failed try spools; the folder is the one given
    options = DeliveryOptions(spool_dir=tmp_path, spool_after=1)
    handle = watch(model, optimizer, transport=down, delivery=options, flush_interval=0.01)
    wait_for(lambda: handle.counters["batches_spooled"] >= 1)
    handle.detach(timeout=0.5)
    assert list(tmp_path.glob("*.spool"))
