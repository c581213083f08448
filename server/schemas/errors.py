"""The body of every error answer."""

from __future__ import annotations

from pydantic import (
    BaseModel,
)


class ErrorPublic(BaseModel):
    """An error answer: `detail` says what was wrong and how to fix it."""

    detail: str
