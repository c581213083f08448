"""Dash's polyfill is replaced by `generator_runtime.RUNTIME` only where that runs every
generator of Dash's scripts; otherwise the page keeps it. (The browser tests render every
page without it and fail on any console error; with `RUNTIME` removed they fail.)"""

from __future__ import annotations

import re

import pytest

from ampwatch.dashboard import generator_runtime
from ampwatch.dashboard.app import create_dash_app

#: Dash's lazy-component readiness helper as Babel compiled it (dash-renderer 4.4).
HELPER = ("setTimeout(i(regeneratorRuntime.mark(function t(){return regeneratorRuntime.wrap("
          "function(t){for(;;)switch(t.prev=t.next){case 0:return t.next=2,r(!0);case 2:"
          'o.isReady=!0;case 3:case"end":return t.stop()}},t)})),0)')  # fmt: skip


def test_the_helper_dash_compiles_is_all_the_runtime_must_run() -> None:
    assert generator_runtime.script_suffices(HELPER)
    assert generator_runtime.script_suffices("no generators here")


@pytest.mark.parametrize(
    "script",
    [
        HELPER.replace("regeneratorRuntime.mark", "regeneratorRuntime.awrap"),  # await in a loop
        HELPER.replace("return t.stop()", 'return t.abrupt("return",1)'),  # return a value
        HELPER.replace("case 2:", "case 2:t.prev=2,t.t0=t.catch(0);"),  # a try/catch
    ],
)
def test_a_generator_the_runtime_cannot_run_keeps_the_polyfill(script: str) -> None:
    assert not generator_runtime.script_suffices(script)
    tags = '<script src="/d/_dash-component-suites/dash/deps/polyfill@7.v4_4_1.min.js"></script>'
    assert generator_runtime.lighter_scripts(tags, suffices=False) == tags
    assert "polyfill" not in generator_runtime.lighter_scripts(tags, suffices=True)


def _script_tags(suffices: bool, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setattr(generator_runtime, "runtime_suffices", lambda: suffices)
    app = create_dash_app("http://127.0.0.1:1", requests_pathname_prefix="/dashboard/")
    page = app.server.test_client().get("/").get_data(as_text=True)
    return re.findall(r"<script[^>]*>", page)


def test_the_page_loads_the_runtime_or_the_polyfill_never_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert generator_runtime.runtime_suffices()  # the installed Dash: its scripts read
    light = _script_tags(True, monkeypatch)
    full = _script_tags(False, monkeypatch)
    assert not any("polyfill" in tag for tag in light)
    assert sum("polyfill" in tag for tag in full) == 1
    # The same scripts otherwise, in the same order: the runtime took the polyfill's place.
    assert [("<script>" if "polyfill" in tag else tag) for tag in full] == light


def test_unreadable_scripts_keep_the_polyfill(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreadable(*args: object, **kwargs: object) -> str:
        raise PermissionError("no")

    monkeypatch.setattr(generator_runtime.Path, "read_text", unreadable)
    generator_runtime.runtime_suffices.cache_clear()
    try:
        assert not generator_runtime.runtime_suffices()
    finally:
        monkeypatch.undo()
        generator_runtime.runtime_suffices.cache_clear()
    assert generator_runtime.runtime_suffices()
