"""The agent's settings: explicit `watch()` arguments, else `AMPWATCH_*` environment variables,
else defaults. One place, so a launcher can configure every rank through the environment.

    AMPWATCH_URL, AMPWATCH_TOKEN, AMPWATCH_RUN (run name), AMPWATCH_RUN_ID (shared client run
    id, e.g. set by the launcher for all ranks), AMPWATCH_PROJECT, AMPWATCH_LAYER_STATS_EVERY,
    AMPWATCH_OFFLINE_FILE, AMPWATCH_DISABLED (1/true/yes/on: a kill switch),
    AMPWATCH_SPOOL_DIR (`spool.default_spool_dir`)

The collector's variables are `ampwatch.server.settings`' (the other home); nothing else
reads `AMPWATCH_*` (the agent's `upload`/`import` and the CLI's remote commands use
`resolve` or `from_environment`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_URL = "http://127.0.0.1:8765"
#: Chosen by measurement (bench/agent_overhead.py): see `watch()`'s docstring.
DEFAULT_LAYER_STATS_EVERY = 20


@dataclass(frozen=True, slots=True)
class Config:
    url: str
    token: str | None
    run: str | None
    run_id: str | None
    project: str | None
    layer_stats_every: int
    offline_file: str | None
    enabled: bool


def from_environment(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """`AMPWATCH_<name>`, or None when unset or empty.

    >>> from_environment("SPOOL_DIR", {"AMPWATCH_SPOOL_DIR": "/scratch"})
    '/scratch'
    >>> from_environment("TOKEN", {"AMPWATCH_TOKEN": ""}) is None
    True
    """
    env = os.environ if environ is None else environ
    return env.get(f"AMPWATCH_{name}") or None


def resolve(
    *,
    url: str | None = None,
    token: str | None = None,
    run: str | None = None,
    run_id: str | None = None,
    project: str | None = None,
    layer_stats_every: int | None = None,
    offline_file: str | None = None,
    enabled: bool | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Merge arguments (None = not given) over the environment over defaults.

    >>> resolve(project="p", environ={"AMPWATCH_PROJECT": "env", "AMPWATCH_TOKEN": "t"})
    ... # doctest: +ELLIPSIS
    Config(url='http://127.0.0.1:8765', token='t', run=None, run_id=None, project='p', ...)

    Raises ValueError, naming the variable, when an environment value does not parse.
    """
    env = os.environ if environ is None else environ

    def pick(value: str | None, name: str) -> str | None:
        return value if value is not None else from_environment(name, env)

    every = layer_stats_every
    if every is None:
        raw = env.get("AMPWATCH_LAYER_STATS_EVERY")
        try:
            every = int(raw) if raw else DEFAULT_LAYER_STATS_EVERY
        except ValueError:
            raise ValueError(
                f"AMPWATCH_LAYER_STATS_EVERY must be an integer >= 1, got {raw!r}"
            ) from None
    # AMPWATCH_DISABLED is a kill switch: it wins even over enabled=True, so an operator can
    # turn the agent off in a job whose code they cannot change.
    disabled = env.get("AMPWATCH_DISABLED", "").strip().lower() in ("1", "true", "yes", "on")
    return Config(
        url=pick(url, "URL") or DEFAULT_URL,
        token=pick(token, "TOKEN"),
        run=pick(run, "RUN"),
        run_id=pick(run_id, "RUN_ID"),
        # Unset: the batch names no project and the collector uses the token's.
        project=pick(project, "PROJECT"),
        layer_stats_every=every,
        offline_file=pick(offline_file, "OFFLINE_FILE"),
        enabled=enabled is not False and not disabled,
    )
