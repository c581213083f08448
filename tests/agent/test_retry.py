"""The one retry policy (agent batches, `ampwatch upload`, webhooks): what each status means."""

from __future__ import annotations

import pytest

from ampwatch.agent.retry import is_retryable, retry_delay


@pytest.mark.parametrize(
    ("status", "retried"),
    [
        (None, True),  # connection refused, reset or timed out: no answer at all
        (408, True),  # a proxy timed the request out: the collector may not have seen it
        (429, True),
        (500, True),
        (503, True),  # the collector's "database unreachable"
        (599, True),
        (301, False),  # a redirect for a POST is a misconfigured URL, not a transient
        (400, False),
        (401, False),  # a refused token stays refused
        (404, False),
        (409, False),
        (410, False),  # a deleted Slack hook does not come back
        (413, False),
        (422, False),
    ],
)
def test_what_each_status_means(status: int | None, retried: bool) -> None:
    assert is_retryable(status) is retried
    assert (retry_delay(1, status) is not None) is retried


def test_408_is_retried_by_the_agent_and_the_webhooks_alike() -> None:
    # they used to disagree: the agent gave up on a 408 that the webhooks retried
    agent = retry_delay(2, 408, base=0.5, cap=30.0, rng=lambda: 1.0)
    webhook = retry_delay(2, 408, base=5.0, cap=900.0, max_attempts=8, rng=lambda: 1.0)
    assert (agent, webhook) == (1.0, 10.0)


def test_max_attempts_gives_up_at_that_attempt_and_none_retries_for_ever() -> None:
    assert retry_delay(4, 503, max_attempts=5, rng=lambda: 0.0) == 2.0
    assert retry_delay(5, 503, max_attempts=5) is None
    assert retry_delay(10_000, 503, cap=30.0, rng=lambda: 0.0) == 15.0
