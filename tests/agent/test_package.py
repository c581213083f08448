"""The package's import contract: the wire module works on a collector host without torch."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path


def _run(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_wire_and_package_import_without_loading_torch() -> None:
    _run(
        "import sys\n"
        "import ampwatch.agent, ampwatch.agent.wire\n"
        "assert 'torch' not in sys.modules, 'torch was imported eagerly'\n"
        "assert sorted(ampwatch.agent.__all__) == ['CriticalAlert', 'EXIT_CRITICAL_ALERT',"
        " 'FiringAlert', 'Lifecycle', 'ResumeFrom', 'WatchHandle', 'load_resume_plan', 'watch']\n"
        "from ampwatch.agent import CriticalAlert, load_resume_plan\n"
        "assert 'torch' not in sys.modules, 'the policy and resume names imported torch'\n"
    )


def test_watch_is_the_function_even_after_its_module_is_imported() -> None:
    _run(
        "import ampwatch.agent.attach\n"
        "from ampwatch.agent import watch, WatchHandle\n"
        "assert callable(watch) and watch.__name__ == 'watch', watch\n"
        "assert WatchHandle.__name__ == 'WatchHandle'\n"
    )


def test_a_process_that_never_detaches_still_flushes_at_exit(tmp_path: Path) -> None:
    out = tmp_path / "bodies"
    out.mkdir()
    _run(
        "import itertools, torch\n"
        "from ampwatch.agent import watch\n"
        "counter = itertools.count()\n"
        "def transport(body, headers):\n"
        f"    (__import__('pathlib').Path({str(out)!r}) / str(next(counter))).write_bytes(body)\n"
        "    return 200\n"
        "model = torch.nn.Linear(2, 2)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "handle = watch(model, opt, transport=transport, flush_interval=60)\n"
        "model(torch.ones(1, 2)).sum().backward()\n"
        "opt.step()\n"
    )
    batches = [json.loads(gzip.decompress(p.read_bytes())) for p in sorted(out.iterdir())]
    events = [e for b in batches for e in b["events"]]
    assert [e["kind"] for e in events] == ["run_start", "run_end"]
    assert events[-1]["data"]["status"] == "exited"
    assert [r["step"] for b in batches for r in b["steps"]] == [1]
