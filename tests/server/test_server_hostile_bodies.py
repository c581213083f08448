"""Hostile bodies on every route the collector documents (`/openapi.json`), with and
without a token, against a collector in its own process (`ampwatch serve`), whose memory
and CPU time are read from /proc:

- without a token, a 100 MB body (declared, or chunked with no length) is a 401 (the
  probes: 200, never read) answered before the body is read, on every route; sent whole
  to the routes that take a body, the collector's peak RSS grows < 50 MiB and it spends
  < 0.5 s of CPU per request. The limit is set above 100 MB here, so what protects it is
  the caller being resolved before the body is read (`api.deps.SessionRoute`), not the
  size check (`body_limit.BodyLimit`, tested where the limit is smaller). Before: a 50 MB
  `POST /api/v1/runs` without a token cost +667 MiB and 5 s.
- with a token, a 256 KiB string in every field of every route's JSON body (as its
  schema names them), as an unknown key, as the whole body, and in the ingest batch's
  free-text slots: a 4xx, never a 5xx, and no answer quotes more than
  `errors.MAX_QUOTED` characters of it (before: 4 MB answers to a 4 MB string).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from wire_batches import make_batch, step_record

from ampwatch.agent.wire import INGEST_PATH
from ampwatch.server.errors import MAX_QUOTED
from ampwatch.server.serving import bind_socket

ADMIN = "admin-token-for-hostile-bodies"
MiB = 2**20
#: Unauthenticated bodies this large; the collector's limit is above it (see the docstring).
BIG = 100 * MiB
#: The hostile string: a run of one letter no answer of the collector's own holds.
FILLER = "Q" * (256 * 1024)
PROBES = {"/healthz", "/readyz"}


@dataclass
class Served:
    url: str
    process: subprocess.Popen[bytes]

    def status(self, key: str) -> int:
        """A `/proc/<pid>/status` figure in MiB (VmRSS, VmHWM: peak RSS)."""
        text = Path(f"/proc/{self.process.pid}/status").read_text()
        (line,) = (row for row in text.splitlines() if row.startswith(f"{key}:"))
        return int(line.split()[1]) // 1024

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`ampwatch serve` (one process, SQLite, tokens required) with a body limit above BIG."""
    sock = bind_socket()
    port = sock.getsockname()[1]
    sock.close()
    folder = tmp_path_factory.mktemp("hostile")
    env = {
        **os.environ,
        "AMPWATCH_DATABASE_URL": f"sqlite:///{folder / 'ampwatch.db'}",
        "AMPWATCH_PORT": str(port),
        "AMPWATCH_DASHBOARD": "false",
        "AMPWATCH_AUTH": "token",
        "AMPWATCH_ADMIN_TOKEN": ADMIN,
        "AMPWATCH_MAX_BODY_BYTES": str(2 * BIG),
    }
    log = (folder / "collector.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "ampwatch.server.cli", "serve"],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=folder,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, (folder / "collector.log").read_text()
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the collector did not become ready"
        time.sleep(0.1)  # polling for readiness, bounded by the deadline
    yield Served(url, process)
    process.terminate()
    process.wait(timeout=30)
    log.close()
    text = (folder / "collector.log").read_text()
    assert "Traceback" not in text, text[-3000:]


@pytest.fixture(scope="module")
def routes(served: Served) -> list[tuple[str, str, dict[str, Any]]]:
    """(method, path with its parameters filled, operation) of every documented route,
    over a run, a webhook and a layer that exist."""
    auth = {"Authorization": f"Bearer {ADMIN}"}
    batch = make_batch(0, steps=[step_record(1, loss=1.0)])
    batch["layer_stats"] = [{"step": 1, "names": ["w"], "stats": {"zero_fraction": [0.5]}}]
    run = httpx.post(f"{served.url}{INGEST_PATH}", json=batch, headers=auth, timeout=30)
    assert run.status_code == 200, run.text
    hook = httpx.post(f"{served.url}/api/v1/webhooks", json={"url": "https://hooks.example/x"},
                      headers=auth, timeout=30)  # fmt: skip
    assert hook.status_code in (200, 201), hook.text
    values = {"run_id": run.json()["run_id"], "webhook_id": hook.json()["id"],
              "project": "default", "layer": "w"}  # fmt: skip
    spec = httpx.get(f"{served.url}/openapi.json", timeout=30).json()
    found = []
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            filled = re.sub(r"\{(\w+)\}", lambda m: str(values[m.group(1)]), path)
            found.append((method.upper(), filled, operation))
    assert len(found) >= 25 and any(p == INGEST_PATH for _, p, _ in found)
    return found


def _chunks(total: int) -> Iterator[bytes]:
    piece = b"[" + b"1," * (MiB // 2 - 1) + b"1]"
    for _ in range(total // len(piece)):
        yield piece


def test_an_unauthenticated_100_mb_body_costs_no_memory(
    served: Served, routes: list[tuple[str, str, dict[str, Any]]]
) -> None:
    """The whole 100 MB sent, declared and chunked, to the routes that take a JSON body."""
    declared = b"[" + b"1," * (BIG // 2) + b"1]"
    writes = [(m, p) for m, p, op in routes if "requestBody" in op or p == INGEST_PATH]
    assert len(writes) >= 5
    peak, cpu = served.status("VmHWM"), served.cpu_seconds()
    slowest = 0.0
    for method, path in writes:
        for content in (declared, _chunks(BIG)):
            started = time.monotonic()
            answer = httpx.request(method, f"{served.url}{path}", content=content,
                                   headers={"Content-Type": "application/json"}, timeout=60)  # fmt: skip
            slowest = max(slowest, time.monotonic() - started)
            assert answer.status_code == 401, (method, path, answer.text[:200])
    requests = 2 * len(writes)
    grown = served.status("VmHWM") - peak
    spent = served.cpu_seconds() - cpu
    print(f"{requests} unauthenticated 100 MB bodies: collector peak RSS +{grown} MiB "
          f"(RSS now {served.status('VmRSS')} MiB), collector CPU {spent:.2f} s in all, "
          f"slowest answer {slowest:.2f} s (the client's send included)")  # fmt: skip
    assert grown < 50
    assert spent < 0.5 * requests


def _answer_before_the_body(url: str, method: str, path: str, *, chunked: bool) -> int:
    """The status of a request whose head announces a 100 MB body of which only the
    first 64 KiB are sent: a collector that waits for the rest times out here."""
    host, port = url.removeprefix("http://").split(":")
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % BIG
    head = b"%s %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%s\r\n\r\n" % (
        method.encode(), path.encode(), host.encode(), framing)  # fmt: skip
    first = b"[" + b"1," * (32 * 1024)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + (b"%x\r\n%s\r\n" % (len(first), first) if chunked else first))
        reply = b""
        while b"\r\n" not in reply:
            data = sock.recv(4096)
            assert data, (method, path, "closed without an answer")
            reply += data
    return int(reply.split(b" ", 2)[1])


def test_every_route_answers_an_unauthenticated_body_before_reading_it(
    served: Served, routes: list[tuple[str, str, dict[str, Any]]]
) -> None:
    for method, path, _ in routes:
        for chunked in (False, True):
            status = _answer_before_the_body(served.url, method, path, chunked=chunked)
            assert status == (200 if path in PROBES else 401), (method, path, chunked)


def _string_paths(
    schema: dict[str, Any], spec: dict[str, Any], depth: int = 0
) -> Iterator[list[str]]:
    """Every property path of a JSON schema (through $ref, anyOf and nested objects)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        yield from _string_paths(spec["components"]["schemas"][name], spec, depth)
        return
    for option in schema.get("anyOf", []):
        yield from _string_paths(option, spec, depth)
    for key, sub in (schema.get("properties") or {}).items():
        yield [key]
        if depth < 3:
            yield from ([key, *rest] for rest in _string_paths(sub, spec, depth + 1))
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict) and depth < 3:  # e.g. rules: {name: {setting: value}}
        yield [FILLER]
        yield from (["skip_rate", *rest] for rest in _string_paths(extra, spec, depth + 1))


def _nested(path: list[str], value: Any) -> Any:
    for key in reversed(path):
        value = {key: value}
    return value


def _ingest_bodies() -> Iterator[Any]:
    """The wire batch's free-text slots and keys, each holding the filler."""
    slots: list[tuple[str, Any]] = [
        ("events", [{"kind": FILLER, "step": 1, "time": 1.0}]),
        ("layer_stats", [{"step": 1, "names": ["w"], "stats": {"zero_fraction": [FILLER]}}]),
        ("layer_stats", [{"step": 1, "names": ["w"], "stats": {FILLER: [0.5]}}]),
        ("layer_stats", [{"step": 1, "names": [FILLER], "stats": {"zero_fraction": [0.5]}}]),
        ("steps", [{**step_record(2, loss=1.0), "loss": FILLER}]),
        ("steps", [{**step_record(2, loss=1.0), FILLER: 1}]),
        (FILLER, 1),
        ("wire_version", FILLER),
    ]
    for key, value in slots:
        yield {**make_batch(1, client_run_id="hostile"), key: value}
    yield {**make_batch(1), "run": {"client_run_id": FILLER, "name": FILLER}}


def test_hostile_bodies_with_a_token_are_4xx_and_never_echoed(
    served: Served, routes: list[tuple[str, str, dict[str, Any]]]
) -> None:
    spec = httpx.get(f"{served.url}/openapi.json", timeout=30).json()
    headers = {"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"}
    peak = served.status("VmHWM")
    sent = 0
    longest_answer = 0
    client = httpx.Client(base_url=served.url, headers=headers, timeout=60)
    for method, path, operation in routes:
        schema = (operation.get("requestBody", {}).get("content", {})
                  .get("application/json", {}).get("schema"))  # fmt: skip
        bodies: list[Any] = [FILLER, {FILLER: FILLER}, [FILLER]]
        if schema is not None:
            bodies += [_nested(p, FILLER) for p in _string_paths(schema, spec)]
        if path == INGEST_PATH:
            bodies += list(_ingest_bodies())
        takes_a_body = schema is not None or path == INGEST_PATH
        for body in [*bodies, None]:
            content = FILLER.encode() if body is None else json.dumps(body).encode()
            answer = client.request(method, path, content=content)
            sent += 1
            where = (method, path, str(body)[:120])
            assert answer.status_code < 500, (*where, answer.text[:300])
            if takes_a_body:
                assert 400 <= answer.status_code < 500, (*where, answer.text[:300])
            if answer.status_code >= 400:
                longest_answer = max(longest_answer, len(answer.content))
                assert len(answer.content) < 16 * 1024, where
            echoed = max(map(len, re.findall("Q+", answer.text)), default=0)
            assert echoed <= MAX_QUOTED, (*where, echoed, answer.text[:300])
    client.close()
    print(f"{sent} hostile bodies of ~256 KiB with a token: longest error answer "
          f"{longest_answer} bytes, peak RSS +{served.status('VmHWM') - peak} MiB "
          f"(now {served.status('VmRSS')} MiB)")  # fmt: skip
    assert served.status("VmHWM") - peak < 256
