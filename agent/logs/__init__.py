"""Training logs as ampwatch runs: `ampwatch import` (a finished log) and `ampwatch follow`
(a log still being written), for runs whose code cannot be changed.

    from ampwatch.agent.logs import parse_file
    parsed = parse_file("train.log")          # format chosen from the content
    print(parsed.format, parsed.reason, len(parsed.steps))

One parser per format family (`megatron`, `deepspeed`, `hf`, `fairseq`, `apex`), each a
line-at-a-time state machine, so `import` and `follow` read a log the same way. Standard
library only, like the rest of the agent's delivery path.
"""

from __future__ import annotations

from ampwatch.agent.logs.detect import FORMATS, detect_format, make_parser
from ampwatch.agent.logs.importer import ParsedLog, import_logs, parse_file
from ampwatch.agent.logs.records import Target
from ampwatch.agent.logs.series import Checkpoint, LogParseError, LogStep, Restart

__all__ = [
    "FORMATS",
    "Checkpoint",
    "LogParseError",
    "LogStep",
    "ParsedLog",
    "Restart",
    "Target",
    "detect_format",
    "import_logs",
    "make_parser",
    "parse_file",
]
