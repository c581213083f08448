"""The plotly.js the browser loads: the cartesian partial bundle when it has been fetched.

Why: the full plotly.js that Dash serves (from the plotly package) is 4.8 MB, and parsing
and running it costs the browser 1.7 s of main-thread time on a 2-core machine, more than
the run page's whole render budget (2 s). Every chart here is a scatter, heatmap or bar
trace, which plotly.js's official cartesian bundle (`plotly.js-cartesian-dist-min` on npm,
1.5 MB) draws identically. It is not on PyPI, so `ampwatch fetch-plotly` (run by
`make setup` and the Dockerfile) downloads the npm tarball, checks it against the pinned
sha512, and stores the one file under `assets_dir()`. When it is missing -- or its version
is not the plotly.js that the installed plotly package targets -- the dashboard serves the
full bundle instead: slower, same charts.

    >>> CARTESIAN_TRACES >= {"scatter", "heatmap", "bar"}
    True
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import sys
import tarfile
from pathlib import Path

import httpx

log = logging.getLogger(__name__)

VERSION = "4.1.1"
PACKAGE = "plotly.js-cartesian-dist-min"
TARBALL = f"https://registry.npmjs.org/{PACKAGE}/-/{PACKAGE}-{VERSION}.tgz"
#: npm's `dist.integrity` for that tarball (`npm view plotly.js-cartesian-dist-min@4.1.1`).
INTEGRITY = (
    "sha512-o8GrFeusncwBIxbBynRJpY4pkgVB6caM+JLpwrLYbbsO7dZ8FJ+SVN2Fr+L7kiG/Z6w4P5O0J"
    "us/Qr5EefHVeg=="
)
MEMBER = "package/plotly-cartesian.min.js"
#: The trace types the cartesian bundle registers (plotly.js `lib/index-cartesian.js`).
CARTESIAN_TRACES = frozenset(
    {
        "scatter",
        "bar",
        "box",
        "heatmap",
        "histogram",
        "histogram2d",
        "histogram2dcontour",
        "contour",
        "image",
        "pie",
        "violin",
        "scatterternary",
    }
)


def assets_dir() -> Path:
    """Where fetched browser assets live: `AMPWATCH_ASSETS_DIR`, else beside the Python
    environment (`<prefix>/share/ampwatch`), so a fresh venv starts without stale files."""
    from ampwatch.server.settings import Settings

    configured = Settings().assets_dir
    return configured if configured is not None else Path(sys.prefix) / "share" / "ampwatch"


def bundle_path(folder: Path | None = None) -> Path:
    """The fetched bundle's file name carries its version, so an upgrade never serves a
    stale one."""
    return (folder or assets_dir()) / f"plotly-cartesian-{VERSION}.min.js"


def plotlyjs_version() -> str:
    """The plotly.js version the installed plotly package writes figures for."""
    from plotly.offline import get_plotlyjs_version

    return str(get_plotlyjs_version())


def cartesian_bundle(folder: Path | None = None) -> Path | None:
    """The fetched cartesian bundle if it is there and matches the plotly package's
    plotly.js version; None means serve the full bundle."""
    path = bundle_path(folder)
    if not path.is_file():
        log.info(
            "plotly.js cartesian bundle not fetched (%s); serving the full 4.8 MB "
            "bundle: `ampwatch fetch-plotly` makes the dashboard load faster",
            path,
        )
        return None
    if (targeted := plotlyjs_version()) != VERSION:
        log.warning(
            "the plotly package targets plotly.js %s, the fetched bundle is %s; "
            "serving the full bundle",
            targeted,
            VERSION,
        )
        return None
    return path


def verify(data: bytes, integrity: str = INTEGRITY) -> None:
    """Raise ValueError unless `data` matches npm's subresource-integrity string."""
    algorithm, _, expected = integrity.partition("-")
    actual = base64.b64encode(hashlib.new(algorithm, data).digest()).decode()
    if actual != expected:
        raise ValueError(f"{TARBALL}: {algorithm} {actual} is not the pinned {expected}")


def fetch(
    folder: Path | None = None,
    *,
    url: str = TARBALL,
    integrity: str = INTEGRITY,
    timeout: float = 60.0,
) -> Path:
    """Download the pinned tarball, check its integrity and store the bundle; returns the
    file. Idempotent: a file already there is kept. Writes through a temporary name so a
    failed download never leaves half a file for the server to serve."""
    path = bundle_path(folder)
    if path.is_file():
        return path
    response = httpx.get(url, timeout=timeout, follow_redirects=True)
    response.raise_for_status()
    verify(response.content, integrity)
    with tarfile.open(fileobj=io.BytesIO(response.content), mode="r:gz") as archive:
        if MEMBER not in archive.getnames():
            raise ValueError(f"{url} holds no {MEMBER}")
        script = archive.extractfile(MEMBER).read()  # type: ignore[union-attr]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    partial.write_bytes(script)
    partial.replace(path)
    return path
