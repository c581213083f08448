"""The webhook client is no SSRF, no port scanner, no memory sink and no time sink:
addresses checked at connect time (allow-listed by an operator only), redirects not
followed, answers read up to a cap, one time limit per delivery, no calls to itself;
Slack text escaped. Real sockets on loopback throughout."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest
from webhook_receiver import WebhookReceiver

from ampwatch.server.webhook_client import MAX_RESPONSE_BYTES, refusal, webhook_client
from ampwatch.server.webhook_delivery import post
from ampwatch.server.webhook_formats import Message, slack_body

LOOPBACK = [ipaddress.ip_network("127.0.0.1/32")]
ADMIN = "admin-secret-for-webhook-tests"


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as live:
        yield live


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "127.8.9.10", "::1", "169.254.169.254", "10.0.0.1", "172.16.5.5",
     "192.168.1.1", "100.64.0.1", "0.0.0.0", "::ffff:127.0.0.1", "::ffff:169.254.169.254",
     "fd00:ec2::254", "fe80::1", "224.0.0.1", "240.0.0.1"],
)  # fmt: skip
def test_non_public_addresses_are_refused_unless_allow_listed(address: str) -> None:
    ip = ipaddress.ip_address(address)
    assert refusal(ip, []) is not None
    network = ipaddress.ip_network(f"{address}/{ip.max_prefixlen}")
    mapped = getattr(ip, "ipv4_mapped", None)
    allowed = [ipaddress.ip_network(f"{mapped}/32")] if mapped else [network]
    assert refusal(ip, allowed) is None


def test_public_addresses_are_allowed() -> None:
    for address in ("93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946", "8.8.8.8"):
        assert refusal(ipaddress.ip_address(address), []) is None


def test_a_loopback_receiver_gets_nothing_by_default(receiver: WebhookReceiver) -> None:
    # By name too: "localhost" is resolved and the address checked, not the name.
    for url in (receiver.url("/hook"), receiver.url("/hook").replace("127.0.0.1", "localhost")):
        with webhook_client(timeout=2.0, allowed=[]) as client:
            outcome = post(client, url, {"hello": 1})
        assert outcome.status is None and "refused" in (outcome.error or ""), outcome
        assert "a loopback address" in (outcome.error or "")
    assert receiver.bodies("/hook") == []
    with webhook_client(timeout=2.0, allowed=LOOPBACK) as client:
        assert post(client, receiver.url("/hook"), {"hello": 1}).delivered
    assert receiver.bodies("/hook") == [{"hello": 1}]


class RawServer:
    """A loopback TCP server whose every connection is handled by `answer(sock)`."""

    def __init__(self, answer: Callable[[socket.socket], None]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.answer = answer
        self.requests = 0
        #: Set when a connection's handler is done (it answered, or the client hung up).
        self.handled = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.requests += 1
            threading.Thread(target=self._handle, args=(sock,), daemon=True).start()

    def _handle(self, sock: socket.socket) -> None:
        with sock:
            sock.recv(65536)  # the request (small: one JSON body)
            try:
                self.answer(sock)
            except OSError:  # the client hung up: what a capped read does
                pass
        self.handled.set()

    def url(self, path: str = "/") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self.listener.close()


def test_redirects_are_not_followed(receiver: WebhookReceiver) -> None:
    target = receiver.url("/elsewhere")

    def redirect(sock: socket.socket) -> None:
        sock.sendall(f"HTTP/1.1 302 Found\r\nLocation: {target}\r\nContent-Length: 0\r\n\r\n"
                     .encode())  # fmt: skip

    server = RawServer(redirect)
    with webhook_client(timeout=2.0, allowed=LOOPBACK) as client:
        outcome = post(client, server.url("/hook"), {"x": 1})
    server.close()
    assert outcome.status == 302 and not outcome.delivered
    assert receiver.bodies("/elsewhere") == []


def test_a_huge_answer_is_read_up_to_the_cap() -> None:
    sent = [0]
    chunk = b"x" * 65536

    def huge(sock: socket.socket) -> None:
        sock.sendall(b"HTTP/1.1 500 Oops\r\nContent-Length: 419430400\r\n\r\n")
        while sent[0] < 400 * 2**20:  # 400 MiB, as the probe's receiver answered
            sock.sendall(chunk)
            sent[0] += len(chunk)

    server = RawServer(huge)
    started = time.monotonic()
    with webhook_client(timeout=10.0, allowed=LOOPBACK) as client:
        outcome = post(client, server.url(), {"x": 1})
    elapsed = time.monotonic() - started
    assert server.handled.wait(10.0)  # the sender has noticed the closed connection
    server.close()
    assert outcome.status == 500 and outcome.error == "HTTP 500: " + "x" * 300
    # What was sent before the client hung up: the cap plus the kernel's socket buffers.
    assert sent[0] < MAX_RESPONSE_BYTES + 16 * 2**20, sent[0]
    assert elapsed < 5.0


def test_a_trickling_receiver_is_cut_off_at_the_total_time_limit() -> None:
    def trickle(sock: socket.socket) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\n")
        for _ in range(200):  # a header byte every 0.1 s: no single read ever times out
            time.sleep(0.1)
            sock.sendall(b"X")

    server = RawServer(trickle)
    started = time.monotonic()
    with webhook_client(timeout=1.0, allowed=LOOPBACK) as client:
        outcome = post(client, server.url(), {"x": 1})
    elapsed = time.monotonic() - started
    server.close()
    assert outcome.status is None and "Timeout" in (outcome.error or ""), outcome
    assert elapsed < 2.0, elapsed


def test_a_webhook_at_the_collector_itself_cannot_make_it_call_itself(
    sqlite_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> None:
    settings = {"admin_token": ADMIN, "webhook_allowed_networks": ["127.0.0.1"]}
    with start_collector(sqlite_url, dashboard=False, **settings) as live:
        api = httpx.Client(base_url=f"{live.url}/api/v1", timeout=30,
                           headers={"Authorization": f"Bearer {ADMIN}"})  # fmt: skip
        hook = api.post("/webhooks", json={"url": f"{live.url}/api/v1/webhooks/1/test"})
        assert hook.json()["id"] == 1
        started = time.monotonic()
        answer = api.post("/webhooks/1/test").json()
        assert time.monotonic() - started < 5.0
        assert answer["delivered"] is False and answer["response_status"] == 403
        assert "may not call the collector" in answer["error"]
        # The refusal says nothing of the token: even the admin's (forwarded) is refused.
        direct = api.post("/webhooks/1/test", headers={"X-Ampwatch-Delivery": "1"})
        assert direct.status_code == 403
        api.close()


def test_the_test_route_refuses_a_loopback_url_without_the_allow_list(
    sqlite_url: str,
    start_collector: Callable[..., AbstractContextManager[Any]],
    receiver: WebhookReceiver,
) -> None:
    with start_collector(sqlite_url, dashboard=False, admin_token=ADMIN) as live:
        headers = {"Authorization": f"Bearer {ADMIN}"}
        api = httpx.Client(base_url=f"{live.url}/api/v1", timeout=30, headers=headers)
        hook = api.post("/webhooks", json={"url": receiver.url("/hook")}).json()
        answer = api.post(f"/webhooks/{hook['id']}/test").json()
        api.close()
    assert answer["delivered"] is False and "refused" in answer["error"]
    assert receiver.bodies("/hook") == []


def test_slack_text_is_escaped() -> None:
    message = Message(
        notification_id=1, kind="alert", transition="firing",
        alert={"rule": "nan_loss", "layer": "<@U123>", "severity": "critical",
               "fired_step": 7, "resolved_step": None, "started_step": 7,
               "message": "see <http://evil.example|the docs> & <!here>"},
        run={"id": 3, "name": "<!channel> job", "url": "http://aw.example/dashboard/run/3"},
        project="<!everyone>",
    )  # fmt: skip
    body = slack_body(message)
    header, *parsed_blocks = body["blocks"]
    assert header["text"]["type"] == "plain_text"  # never parsed by Slack: shown as is
    rendered = repr([body["text"], parsed_blocks])
    for raw in ("<!channel>", "<!here>", "<!everyone>", "<@U123>", "<http://evil"):
        assert raw not in rendered, raw
    assert "&lt;!channel&gt; job" in body["text"]
    assert "&lt;http://evil.example|the docs&gt; &amp; &lt;!here&gt;" in body["text"]
    assert body["text"].endswith("<http://aw.example/dashboard/run/3|open run>")  # ours
