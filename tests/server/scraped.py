"""Reading `/metrics` back in tests: the exposition text as {(name, labels): value}."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import httpx

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Key = tuple[str, frozenset[tuple[str, str]]]


def parse(text: str) -> dict[Key, float]:
    """Samples by (name, labels); label values unescaped, `NaN`/`+Inf` as floats."""
    samples: dict[Key, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        assert match, line
        name, labels, value = match.groups()
        pairs = frozenset(
            (key, re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], raw))
            for key, raw in _LABEL.findall(labels or "")
        )
        samples[(name, pairs)] = float(value)
    return samples


def series(
    samples: dict[Key, float], name: str, **labels: str
) -> dict[frozenset[tuple[str, str]], float]:
    """The samples of `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return {key[1]: value for key, value in samples.items() if key[0] == name and wanted <= key[1]}


def value(samples: dict[Key, float], name: str, **labels: str) -> float | None:
    """The one sample of `name` matching `labels`, None when there is none."""
    found = series(samples, name, **labels)
    assert len(found) <= 1, (name, labels, found)
    return next(iter(found.values()), None)


def scrape(url: str, token: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"{url}/metrics", headers=headers, timeout=30)


def promtool() -> str | None:
    """Debian's promtool (package `prometheus`), or None where it is not installed."""
    return shutil.which("promtool") or (
        "/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None
    )
