"""The `ampwatch` command. Each group's module adds its subcommands to one parser:
`collector` (`serve`, `demo`), `admin` (`db upgrade|downgrade`, `age-layer-stats`,
`fetch-plotly`), `tokens` (`token create|list|revoke`), `upload`, the agent's
`ampwatch.agent.logs.cli` (`import`, `follow`), and `remote` (`restart-candidates`,
`webhook add|list|remove|test`), in the order `ampwatch --help` lists them.

argparse rather than a CLI framework: a dozen subcommands do not justify a dependency, and
the collector host installs as little as possible.

    ampwatch serve --port 8765        # the console script: main()
    python -m ampwatch.server.cli serve
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ampwatch.agent.logs.cli import add_log_commands
from ampwatch.server.cli import admin, collector, remote, tokens, upload


def build_parser() -> argparse.ArgumentParser:
    """The `ampwatch` parser; each subcommand's `func` runs it and returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="ampwatch",
        description="Training-health monitor for mixed-precision PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    collector.add_commands(sub)
    admin.add_commands(sub)
    tokens.add_commands(sub)
    upload.add_commands(sub)
    add_log_commands(sub)
    remote.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command `argv` (default: the process's arguments) names; its exit status.

    >>> main(["token", "list", "--database-url", "sqlite:///ampwatch.db"])  # doctest: +SKIP
    0
    """
    args = build_parser().parse_args(argv)
    return int(args.func(args))
