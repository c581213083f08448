"""The HTTP client webhook deliveries go through: address-checked and bounded.

A webhook URL is chosen by a tenant, and the collector POSTs to it and records what came
back, so without care it is an SSRF and a port scanner: a probe made it POST to loopback
and link-local addresses and read the status and the first 300 characters back; a
400 MiB answer took the collector from 149 MiB to 1.3 GiB; a receiver trickling one byte
at a time held a delivery thread for 30 s under a 5 s timeout (httpx's timeouts are per
phase). Here:

- the address is checked when the connection is made, on the address actually dialled
  (`_CheckedBackend`: resolve, check every address, connect to a checked one, never
  resolve again), so a DNS name that answers a public address to a check and a private
  one to the connection (DNS rebinding) gains nothing. Refused unless the operator
  allow-lists them (`Settings.webhook_allowed_networks`): loopback, private, link-local
  (the cloud metadata address 169.254.169.254 included), shared, reserved, multicast and
  unspecified addresses, IPv4-mapped IPv6 forms of them too (`refusal`);
- no proxy from the environment, no redirects (a webhook URL is exact), a new connection
  per delivery (no keep-alive), whose reads and writes all share one deadline
  (`webhook_timeout` in total: `_DeadlineStream`);
- at most `MAX_RESPONSE_BYTES` of an answer are read;
- every delivery carries `DELIVERY_HEADER`, and the collector's API refuses requests that
  carry it (`api.deps.get_principal`), so a webhook pointed at the collector's own
  `/webhooks/{id}/test` cannot make it call itself in a loop.

>>> client = webhook_client(timeout=5.0, allowed=())  # doctest: +SKIP
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
import time
from collections.abc import Iterable, Sequence
from typing import Any

import httpcore
import httpx

USER_AGENT = "ampwatch-notify/1"
#: Sent with every delivery; the collector's own API refuses requests that carry it.
DELIVERY_HEADER = "X-Ampwatch-Delivery"
#: Most of a receiver's answer read (only its first characters are ever recorded).
MAX_RESPONSE_BYTES = 64 * 1024

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def refusal(address: IPAddress, allowed: Sequence[IPNetwork]) -> str | None:
    """Why a delivery may not connect to `address` (None: it may).

    >>> refusal(ipaddress.ip_address("169.254.169.254"), [])
    'a link-local address (cloud metadata lives there)'
    >>> refusal(ipaddress.ip_address("127.0.0.1"), [ipaddress.ip_network("127.0.0.1/32")])
    """
    if any(address in network for network in allowed if network.version == address.version):
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return refusal(address.ipv4_mapped, allowed)
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address (cloud metadata lives there)"
    if address.is_unspecified or address.is_multicast or not address.is_global:
        return "a private or reserved address"
    return None


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose reads and writes all end by one deadline, whatever the
    per-operation timeout: a trickling receiver cannot stretch a delivery."""

    def __init__(self, stream: httpcore.NetworkStream, deadline: float) -> None:
        self._stream = stream
        self._deadline = deadline

    def _left(self, timeout: float | None, error: type[Exception]) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise error("the delivery ran past its total time limit")
        return left if timeout is None else min(timeout, left)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, self._left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, self._left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        wrapped = self._stream.start_tls(
            ssl_context, server_hostname, self._left(timeout, httpcore.ConnectTimeout)
        )
        return _DeadlineStream(wrapped, self._deadline)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _CheckedBackend(httpcore.SyncBackend):
    """Resolves, checks and connects in one step (module docstring)."""

    def __init__(self, *, total_timeout: float, allowed: Sequence[IPNetwork]) -> None:
        self._total = total_timeout
        self._allowed = tuple(allowed)

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        deadline = time.monotonic() + self._total
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as error:
            raise httpcore.ConnectError(f"cannot resolve {host!r}: {error}") from None
        addresses = list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))
        reasons = {address: refusal(address, self._allowed) for address in addresses}
        usable = [address for address, reason in reasons.items() if reason is None]
        if not usable:
            address, reason = next(iter(reasons.items()))
            raise httpcore.ConnectError(
                f"refused: {host} is {address}, {reason}; an operator may allow it with "
                "AMPWATCH_WEBHOOK_ALLOWED_NETWORKS"
            )
        left = max(0.001, deadline - time.monotonic())
        stream = super().connect_tcp(
            str(usable[0]), port, left if timeout is None else min(timeout, left),
            local_address, socket_options,
        )  # fmt: skip
        return _DeadlineStream(stream, deadline)


def webhook_client(*, timeout: float, allowed: Sequence[IPNetwork]) -> httpx.Client:
    """The client every delivery goes through (module docstring): `timeout` is the total
    time one delivery may take, `allowed` the networks an operator allow-listed."""
    transport = httpx.HTTPTransport(trust_env=False)
    # httpx takes no network backend; its pool is rebuilt with one (httpcore's public API).
    transport._pool = httpcore.ConnectionPool(
        ssl_context=ssl.create_default_context(cafile=_ca_bundle()),
        max_keepalive_connections=0,  # a fresh connection, and deadline, per delivery
        network_backend=_CheckedBackend(total_timeout=timeout, allowed=allowed),
    )
    return httpx.Client(
        transport=transport,
        timeout=timeout,
        follow_redirects=False,
        trust_env=False,
        # identity: the capped read below counts bytes as sent, never a decompressed bomb.
        headers={"User-Agent": USER_AGENT, DELIVERY_HEADER: "1", "Accept-Encoding": "identity"},
    )


def _ca_bundle() -> str | None:
    try:
        import certifi  # httpx's own dependency: the CA bundle it verifies with
    except ImportError:  # pragma: no cover
        return None
    return str(certifi.where())


def read_capped(response: httpx.Response, limit: int = MAX_RESPONSE_BYTES) -> bytes:
    """At most `limit` bytes of a streamed `response`'s body, as sent (not decoded)."""
    body = bytearray()
    for chunk in response.iter_raw():
        body += chunk
        if len(body) >= limit:
            break
    return bytes(body[:limit])
