"""The integrations import their framework only when used: the agent, and the
integrations package itself, load none of them."""

from __future__ import annotations

import subprocess
import sys


def test_the_agent_and_the_integrations_package_import_no_framework() -> None:
    code = (
        "import sys\n"
        "import ampwatch.agent.attach, ampwatch.integrations\n"
        "loaded = {'lightning', 'pytorch_lightning', 'transformers', 'accelerate',"
        " 'deepspeed'} & set(sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
