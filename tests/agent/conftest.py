"""Fixtures for agent tests."""

from __future__ import annotations

import pytest
from agent_fakes import FakeCollector


@pytest.fixture
def collector() -> FakeCollector:
    return FakeCollector()
