"""The install matrix, where no Docker engine runs: fresh venvs (`python -m venv`, pip)
holding exactly what an install holds, running the commands that install must run.

- The image's install set: the Dockerfile's sources (its COPY lines) and its
  `pip install` spec (`.[server,postgres]`, no torch), then the rest of its RUN line (the
  build's own checks), then the compose services' commands against PostgreSQL: `migrate`
  (`ampwatch db upgrade`), the documented `token create --scope metrics` step, the
  `collector` (`ampwatch serve`, two workers, as compose sets it) with compose's
  healthcheck, and the `dashboard`. Before (issue 26): every one of them exited 1 with
  `ModuleNotFoundError: torch`, hidden in the build by `ampwatch fetch-plotly || true`.
- The `[agent]` extra alone (torch, no fastapi/httpx/SQLAlchemy/pydantic): `ampwatch
  import`, `upload` and `follow` into a collector (before: `import httpx` failed).

Each venv is made once per session and shared by the tests that need it; torch comes
from whatever index pip is configured with. Both install ampwatch from one wheel built once
from the image's sources (what pip would build from the folder for each). Their modules
are compiled to bytecode as they are first imported and kept (the suite may run with
PYTHONDONTWRITEBYTECODE, under which every command of a venv installed uncompiled compiled
fastapi, SQLAlchemy, dash and plotly from source again: 8 s for `token create`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
LOG = ROOT / "tests" / "data" / "real_logs" / "tr8-104B-exp11-spike.log"
ADMIN = "admin-token-for-the-image-test"
#: Making a venv takes minutes on a loaded machine; each is made once per session.
pytestmark = pytest.mark.timeout(1800)
#: Modules an install must not hold, by extra set.
SERVER_ONLY_LACKS = ["torch"]
AGENT_ONLY_LACKS = ["fastapi", "httpx", "sqlalchemy", "pydantic", "uvicorn", "numpy"]


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 900,
         cwd: Path | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=cwd, check=False)  # fmt: skip


def _image_install() -> tuple[list[Path], str, str]:
    """The Dockerfile's COPY sources, its `pip install` spec, and what its RUN line does
    after the install (joined with `&&`)."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    copied = [ROOT / source for line in re.findall(r"^COPY (.+)$", text, re.M)
              for source in line.split()[:-1]]  # fmt: skip
    (run,) = re.findall(r"^RUN (.+)$", text, re.M)
    install, _, after = run.partition("&&")
    (spec,) = re.findall(r'pip install (?:--\S+ )*"([^"]+)"', install)
    return copied, spec, after.strip()


def _venv(folder: Path, *requirements: str) -> Path:
    """A fresh venv at `folder` with `requirements` pip-installed; its bin folder.

    Installed by this interpreter's pip (`--python`), uncompiled: ensurepip and byte-compiling
    plotly's and torch's thousands of modules were most of the time."""
    made = _run(sys.executable, "-m", "venv", "--without-pip", str(folder))
    assert made.returncode == 0, made.stderr
    bin_dir = folder / "bin"
    for requirement in requirements:  # in order: torch before the extra that needs it
        installed = _run(sys.executable, "-m", "pip", "--python", str(bin_dir / "python"),
                         "install", "-q", "--no-compile", requirement)  # fmt: skip
        assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    return bin_dir


def _lacks(bin_dir: Path, modules: list[str]) -> None:
    probe = (
        "import importlib.util as u, sys\n"
        "found = [m for m in sys.argv[1:] if u.find_spec(m)]\n"
        "sys.exit(f'{found}' if found else 0)"
    )
    result = _run(str(bin_dir / "python"), "-c", probe, *modules)
    assert result.returncode == 0, f"installed although not in this extra set: {result.stderr}"


@pytest.fixture(scope="session")
def image_source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """/app as the image's build lays it out (its COPY lines), its pip spec, the rest of
    its RUN line."""
    app = tmp_path_factory.mktemp("image") / "app"
    copied, spec, after = _image_install()
    app.mkdir()
    for source in copied:
        if source.is_dir():
            shutil.copytree(source, app / source.name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, app / source.name)
    return app, spec, after


@pytest.fixture(scope="session")
def ampwatch_wheel(
    image_source: tuple[Path, str, str], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """ampwatch's wheel, built once from /app (the image's sources) for both venvs."""
    app, _, _ = image_source
    folder = tmp_path_factory.mktemp("wheel")
    built = _run(
        sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(folder), str(app)
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = folder.glob("ampwatch-*.whl")
    return wheel


@pytest.fixture(scope="session")
def server_venv(
    image_source: tuple[Path, str, str],
    ampwatch_wheel: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """The image's install set in a fresh venv; the bin folder (`ampwatch`, `python`)."""
    _, spec, _ = image_source
    assert spec.startswith(".[") and "server" in spec and "agent" not in spec, spec
    bin_dir = _venv(tmp_path_factory.mktemp("server-venv") / "venv", str(ampwatch_wheel) + spec[1:])
    _lacks(bin_dir, SERVER_ONLY_LACKS)
    return bin_dir


@pytest.fixture(scope="session")
def agent_venv(ampwatch_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `[agent]` extra alone in a fresh venv (torch first, the version this suite runs)."""
    torch = pytest.importorskip("torch")
    version = torch.__version__.split("+")[0]
    bin_dir = _venv(tmp_path_factory.mktemp("agent-venv") / "venv", f"torch=={version}",
                    f"{ampwatch_wheel}[agent]")  # fmt: skip
    _lacks(bin_dir, AGENT_ONLY_LACKS)
    return bin_dir


def _env(bin_dir: Path, **settings: str) -> dict[str, str]:
    """A clean environment: the venv first on PATH, no AMPWATCH_* of this process, and
    bytecode written (see the module docstring)."""
    dropped = ("AMPWATCH_", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")
    kept = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    return {**kept, "PATH": f"{bin_dir}{os.pathsep}{kept.get('PATH', '')}", **settings}


def _compose_service(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text())["services"][name])


def _default(value: Any) -> str:
    """What compose sets with nothing in .env: `${VAR:-default}` -> default."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))


def _free_port() -> int:
    from ampwatch.server.serving import bind_socket

    sock = bind_socket()
    port = int(sock.getsockname()[1])
    sock.close()
    return port


def _wait_until(check: Callable[[], bool], process: subprocess.Popen[str], what: str) -> None:
    deadline = time.monotonic() + 120
    while not check():
        if process.poll() is not None:
            raise AssertionError(f"{what} exited: {process.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, f"{what} did not become ready"
        time.sleep(0.2)  # polling for readiness, bounded by the deadline


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.postgres
def test_the_image_install_set_runs_the_compose_services(
    server_venv: Path, image_source: tuple[Path, str, str], postgres_url: str
) -> None:
    app, _, after_install = image_source
    env = _env(server_venv)
    # The rest of the image's RUN line: its own checks (fetch-plotly may go without npm).
    built = _run("bash", "-c", after_install, env=env, cwd=app)
    assert built.returncode == 0, built.stdout + built.stderr
    assert "Traceback" not in built.stderr, built.stderr

    database = {"AMPWATCH_DATABASE_URL": postgres_url}
    migrate = _compose_service("migrate")["command"]
    migrated = _run(*migrate, env=_env(server_venv, **database))
    assert migrated.returncode == 0 and "upgrade done" in migrated.stdout, migrated.stderr
    created = _run("ampwatch", "token", "create", "--admin", "--scope", "metrics",
                   env=_env(server_venv, **database))  # fmt: skip
    assert created.returncode == 0, created.stderr
    scraper = created.stdout.split()[-1]
    writer_made = _run("ampwatch", "token", "create", "--project", "vision",
                       env=_env(server_venv, **database))  # fmt: skip
    writer = writer_made.stdout.split()[-1]
    assert writer.startswith("aw_") and scraper.startswith("aw_"), writer_made.stderr

    collector = _compose_service("collector")
    port = _free_port()
    settings = {key: _default(value) for key, value in collector["environment"].items()
                if key.startswith("AMPWATCH_") and ":?" not in str(value)}  # fmt: skip
    settings |= {"AMPWATCH_WORKERS": "2", "AMPWATCH_HOST": "127.0.0.1",
                 "AMPWATCH_PORT": str(port), "AMPWATCH_ADMIN_TOKEN": ADMIN, **database}  # fmt: skip
    served = subprocess.Popen(collector["command"], env=_env(server_venv, **settings),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)  # fmt: skip
    dashboard: subprocess.Popen[str] | None = None
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until(lambda: _answers(f"{url}/readyz"), served, "the collector")
        # compose's healthcheck, in the image's python, at this port
        check = collector["healthcheck"]["test"][1:]
        healthy = _run(*[part.replace("8765", str(port)) for part in check], env=env)
        assert healthy.returncode == 0, healthy.stderr

        batch = {"wire_version": 1, "run": {"client_run_id": "img", "name": "img"},
                 "stream": "5eed", "seq": 0, "steps": [{"step": 1, "rank": 0, "skipped": False,
                 "loss": 1.5, "loss_scale": 1024.0, "grad_norm": 1.0, "lr": 0.1,
                 "act_norm_mean": None, "act_norm_max": None}], "layer_stats": [],
                 "events": [], "dropped": {"steps": 0, "layer_stats": 0, "events": 0}}  # fmt: skip
        stored = httpx.post(f"{url}/api/v1/ingest", json=batch, timeout=30,
                            headers={"Authorization": f"Bearer {writer}"})  # fmt: skip
        assert stored.status_code == 200, stored.text
        scraped = httpx.get(f"{url}/metrics", timeout=30,
                            headers={"Authorization": f"Bearer {scraper}"})  # fmt: skip
        assert scraped.status_code == 200
        assert "ampwatch_ingest_steps_total 1" in scraped.text.splitlines()

        command = _compose_service("dashboard")["command"]
        dashboard_port = _free_port()
        command = [part.replace("http://collector:8765", url).replace("0.0.0.0", "127.0.0.1")
                   .replace("8050", str(dashboard_port)) for part in command]  # fmt: skip
        dashboard = subprocess.Popen(
            [str(server_venv / "python"), *command[1:]],
            env=_env(server_venv, AMPWATCH_DASHBOARD_TOKEN=writer),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        _wait_until(lambda: _answers(f"http://127.0.0.1:{dashboard_port}/"), dashboard,
                    "the dashboard")  # fmt: skip
    finally:
        for process in (served, dashboard):
            if process is not None:
                if process is served:
                    os.killpg(process.pid, signal.SIGTERM)
                else:
                    process.terminate()
                _, errors = process.communicate(timeout=60)
                assert "Traceback" not in errors, errors[-3000:]


def test_the_agent_extra_alone_imports_follows_and_uploads(
    agent_venv: Path,
    tmp_path: Path,
    sqlite_url: str,
    start_collector: Callable[..., AbstractContextManager[Any]],
) -> None:
    with start_collector(sqlite_url, dashboard=False) as live:
        env = _env(agent_venv, AMPWATCH_URL=live.url, AMPWATCH_SPOOL_DIR=str(tmp_path / "spool"))
        imported = _run("ampwatch", "import", str(LOG), "--run", "imported", env=env)
        assert imported.returncode == 0, imported.stdout + imported.stderr
        assert "batches stored" in imported.stdout, imported.stdout

        offline = tmp_path / "offline.jsonl"
        written = _run("ampwatch", "import", str(LOG), "--run", "offline", "--run-id", "offline-1", "--offline",
                       str(offline), env=env)  # fmt: skip
        assert written.returncode == 0 and offline.stat().st_size > 0, written.stderr
        uploaded = _run("ampwatch", "upload", str(offline), env=env)
        assert uploaded.returncode == 0, uploaded.stdout + uploaded.stderr
        assert re.search(r": [1-9]\d* batches stored", uploaded.stdout), uploaded.stdout

        followed_log = tmp_path / "train.log"
        lines = [line for line in LOG.read_text().splitlines(keepends=True)
                 if line.startswith(" iteration ")]  # fmt: skip
        followed_log.write_text(lines[0])
        follower = subprocess.Popen(
            ["ampwatch", "follow", str(followed_log), "--run", "followed", "--poll", "0.05"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

        def runs() -> dict[str, int]:
            listed = httpx.get(f"{live.url}/api/v1/runs", timeout=10).json()["runs"]
            return {run["name"]: run["steps"] for run in listed}

        try:
            with followed_log.open("a") as out:
                out.writelines(lines[1:])
            deadline = time.monotonic() + 120
            while runs().get("followed") != len(lines):
                assert follower.poll() is None, follower.communicate()[0]
                assert time.monotonic() < deadline, runs()
                time.sleep(0.1)  # polling the collector, bounded by the deadline
        finally:
            follower.send_signal(signal.SIGINT)
            output, _ = follower.communicate(timeout=60)
        assert follower.returncode == 0, output
        assert runs() == {"imported": len(lines), "offline": len(lines), "followed": len(lines)}
