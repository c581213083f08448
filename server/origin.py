"""Browsers are not local callers: while the collector trusts local callers (no token,
loopback bind), a request whose `Host` is not this collector's, or whose `Origin` is
another site, is refused with 403.

Local trust (`auth.trusts_everyone`) assumes only processes on this machine can connect,
but a browser on this machine connects for any page it shows: a page of another origin
created and ended runs with a `text/plain` POST (a "simple" request, sent without a CORS
preflight), and a DNS name rebound to 127.0.0.1 reads the API under the attacker's
`Host`. Browsers always send `Origin` on such writes and cannot forge `Host`, so:

- `Host` must be a loopback name or address, or the host of `public_url`/`dashboard_url`;
- `Origin`, when sent, must be the collector's own (same scheme, host and port as
  `Host`), or one of `cors_origins`, `public_url`, `dashboard_url`.

Active while the collector listens on loopback and `auth` is not `token` (with tokens
required, a page has none to send). Beyond loopback, tokens are required anyway.

Always, whatever the mode: a request from this collector's own webhook client
(`webhook_client.DELIVERY_HEADER`) is refused before any route, on the event loop: a
webhook pointed at the collector (its `/webhooks/{id}/test`, say) would make it call
itself, each call holding a worker thread while it waits for the next.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from ampwatch.server.auth import is_loopback
from ampwatch.server.errors import bounded_message
from ampwatch.server.settings import Settings
from ampwatch.server.webhook_client import DELIVERY_HEADER


def _origin_of(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower() if parts.scheme and parts.netloc else ""


def foreign_browser_request(headers: Headers, scheme: str, settings: Settings) -> str | None:
    """Why a request is refused in local trust (None: it is not)."""
    host = headers.get("host", "")
    hostname = urlsplit(f"//{host}").hostname or ""
    known = {urlsplit(url).hostname for url in (settings.public_url, settings.dashboard_url) if url}
    if not (is_loopback(hostname) or hostname in known):
        return (
            f"Host {host!r} is not this collector's: a browser page on a rebound DNS name? "
            "Set AMPWATCH_PUBLIC_URL to the address clients use"
        )
    origin = headers.get("origin")
    if origin is None:
        return None
    allowed = {f"{scheme}://{host}".lower(), *map(_origin_of, settings.cors_origins)}
    allowed |= {_origin_of(url) for url in (settings.public_url, settings.dashboard_url) if url}
    if origin.lower() not in allowed:
        return (
            f"Origin {origin!r} is another site: a page there may not use a collector that "
            "trusts local callers (allow it with AMPWATCH_CORS_ORIGINS, or use tokens)"
        )
    return None


#: Probes answer whatever the Host: load balancers and orchestrators use any name.
PROBE_PATHS = frozenset({"/healthz", "/readyz"})


class LocalTrustGuard:
    """ASGI middleware applying `foreign_browser_request` (`main.create_app`)."""

    def __init__(self, app: ASGIApp, *, settings: Settings) -> None:
        self.app = app
        self._settings = settings
        self._active = settings.auth != "token" and is_loopback(settings.host)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            reason = None
            if DELIVERY_HEADER in headers:
                reason = "webhook deliveries may not call the collector"
            elif self._active and scope.get("path") not in PROBE_PATHS:
                reason = foreign_browser_request(headers, scope["scheme"], self._settings)
            if reason is not None:
                answer = JSONResponse({"detail": bounded_message(reason)}, status_code=403)
                await answer(scope, receive, send)
                return
        await self.app(scope, receive, send)
