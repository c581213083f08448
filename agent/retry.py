"""The one retry policy of every ampwatch delivery: agent batches, `ampwatch upload` and the
collector's webhook notifications (`ampwatch.server.webhook_delivery`).

Standard library only: the collector imports it without torch.

What a status means:
- None (connection refused, reset, timed out), 408 Request Timeout (a proxy gave up
  waiting), 429 Too Many Requests and any 5xx: the far end may answer later: retry.
- Any other status (3xx, the other 4xx: a revoked Slack hook's 404/410, a malformed
  body's 400/422, a refused token's 401/403): it will fail the same way again: give up.
- Retry-After is not read: neither caller sees response headers (the agent's `Transport`
  returns the status only), and the collector's own Retry-After on a 503 (1 s) is below
  what the backoff reaches after a few tries anyway.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Final

#: Client errors that a later try may get past.
RETRYABLE_CLIENT_ERRORS: Final = frozenset({408, 429})


def is_retryable(status: int | None) -> bool:
    """Whether a try that ended with HTTP `status` (None: no answer at all) may succeed
    if tried again.

    >>> [is_retryable(s) for s in (None, 408, 429, 503, 404)]
    [True, True, True, True, False]
    """
    return status is None or status in RETRYABLE_CLIENT_ERRORS or status >= 500


def retry_delay(
    attempt: int,
    status: int | None,
    *,
    base: float = 0.5,
    cap: float = 30.0,
    max_attempts: int | None = None,
    rng: Callable[[], float] = random.random,
) -> float | None:
    """Seconds to wait before the try after failed try number `attempt` (1, 2, ...), or
    None to give up: at once for a status `is_retryable` refuses, or once `attempt`
    reaches `max_attempts` (None: retry for ever; the agent's buffer bounds its memory,
    and a collector outage must not end a run's reporting).

    Delay: exponential (base, 2·base, 4·base, ...), capped, with "equal jitter" (half
    fixed, half random) so that many ranks, or one incident's notifications to one dead
    webhook, spread out but never retry in a tight loop.

    >>> retry_delay(3, 503, base=1.0, cap=30.0, rng=lambda: 0.0)
    2.0
    >>> retry_delay(8, 503, base=5.0, max_attempts=8) is None
    True
    """
    if not is_retryable(status) or (max_attempts is not None and attempt >= max_attempts):
        return None
    # The exponent is bounded: retrying for ever, 2.0 ** 1024 overflows (1,025 tries: 6-8 h
    # of a collector outage at the agent's 30 s cap), which would stop the sender thread.
    ceiling = min(cap, base * 2.0 ** min(attempt - 1, 64))
    return ceiling / 2 + rng() * ceiling / 2
