"""Dash's @babel/polyfill replaced by the one piece of it that Dash's scripts use.

Why: Dash serves @babel/polyfill (core-js 2 and regenerator) before its own scripts, for
browsers older than ES2015. A current browser has every standard feature natively, so
core-js only costs: evaluating it took ~130 ms of a cold page's main thread on 2 cores,
and it replaces natives it judges broken (`app.NATIVES` puts them back). What Dash's
scripts take from it is `regeneratorRuntime`, for one generator. Babel compiled Dash's
lazy-component readiness helper to `regeneratorRuntime.mark` and `.wrap` over a state
machine that only yields and returns. `RUNTIME` implements exactly that much: `wrap`
returns an iterator whose `next` runs the machine from its context's `next` label, and
`stop` ends it.

Checked, not assumed: `runtime_suffices` reads the scripts Dash serves and accepts only
`regeneratorRuntime.mark` and `.wrap`, with state machines that touch no context member
but `prev`, `next`, `sent` and `stop` (a try/catch or a `return x` would use `abrupt`,
`catch` or `rval`). A Dash whose scripts need more keeps its polyfill (`lighter_scripts`).

>>> lighter_scripts('<script src="/_dash-component-suites/dash/deps/polyfill@7.v4.min.js">'
...                 '</script>\\n<script src="/r.js"></script>', suffices=True).count("src=")
1
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import dash

#: `window.regeneratorRuntime` for generators that yield and return, nothing else.
RUNTIME = """window.regeneratorRuntime = {
  mark: function (generator) { return generator; },
  wrap: function (machine, outer, self) {
    var context = {prev: 0, next: 0, sent: undefined, done: false,
      stop: function () { context.done = true; }};
    return {
      next: function (sent) {
        if (context.done) return {value: undefined, done: true};
        context.sent = sent;
        var value = machine.call(self, context);
        return {value: context.done ? undefined : value, done: context.done};
      },
      throw: function (error) { context.done = true; throw error; }
    };
  }
};"""
#: The context members `RUNTIME` supports.
CONTEXT_MEMBERS = frozenset({"prev", "next", "sent", "stop"})
_POLYFILL_TAG = re.compile(r'<script src="[^"]*/deps/polyfill@[^"]*"></script>')
_MEMBER = re.compile(r"regeneratorRuntime\.(\w+)")
_MACHINE = re.compile(r"regeneratorRuntime\.wrap\(function\((\w+)\)\{")
#: The folders of the Dash package whose scripts a dashboard page may load.
_SCRIPT_DIRS = ("dash-renderer/build", "dcc", "html", "dash_table")


def _machine_body(text: str, start: int) -> str:
    """The function body that opens just before `start`, up to its closing brace."""
    depth = 1
    for end in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[start:end]
    return text[start:]


def script_suffices(text: str) -> bool:
    """Whether `RUNTIME` runs every generator in the script `text`."""
    if not set(_MEMBER.findall(text)) <= {"mark", "wrap"}:
        return False
    for machine in _MACHINE.finditer(text):
        body = _machine_body(text, machine.end())
        used = set(re.findall(rf"\b{re.escape(machine.group(1))}\.(\w+)", body))
        if not used <= CONTEXT_MEMBERS:
            return False
    return True


@functools.cache
def runtime_suffices() -> bool:
    """Whether every script the installed Dash serves needs no more than `RUNTIME` (a
    script that cannot be read: no, and the page keeps its polyfill)."""
    root = Path(dash.__file__).parent
    try:
        return all(
            script_suffices(path.read_text(encoding="utf-8", errors="replace"))
            for folder in _SCRIPT_DIRS
            for path in sorted((root / folder).glob("*.js"))
        )
    except OSError:
        return False


def lighter_scripts(scripts: str, *, suffices: bool | None = None) -> str:
    """Dash's script tags with its polyfill's replaced by `RUNTIME` inline, when that
    suffices (`runtime_suffices`, unless given)."""
    if not (runtime_suffices() if suffices is None else suffices):
        return scripts
    return _POLYFILL_TAG.sub(lambda _: f"<script>{RUNTIME}</script>", scripts, count=1)
