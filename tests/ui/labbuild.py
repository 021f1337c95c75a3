"""The JupyterLab extension the browser tests load: this checkout's build, fresh.

A venv holds an installed copy of the extension (``share/jupyter/labextensions/nbdist``,
from the last ``pip install``) that JupyterLab finds before a user data folder, so a
test could exercise a stale build without noticing. Here the build in
``nbdist/labextension`` is rebuilt (``jlpm build``) when ``labextension/``'s sources are
newer, linked into a folder each server gets as ``extra_labextensions_path`` (searched
first), and :func:`served_labextension` reads which build a page really loads.
"""

from __future__ import annotations

import fcntl
import html.parser
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILT = ROOT / "nbdist" / "labextension"  # what `jlpm build` in labextension/ writes
SOURCES = ROOT / "labextension"

__all__ = ["BUILT", "SOURCES", "labextension_build", "link_labextension", "served_labextension"]


def _newest_source() -> tuple[float, Path | None]:
    """The newest file among the extension's sources (mtime, path)."""
    newest, which = 0.0, None
    for pattern in ("src/**/*", "style/**/*", "package.json", "tsconfig.json"):
        for path in SOURCES.glob(pattern):
            if path.is_file() and path.stat().st_mtime > newest:
                newest, which = path.stat().st_mtime, path
    return newest, which


def labextension_build() -> str:
    """This checkout's JupyterLab extension build, rebuilt when its sources are newer.

    Returns the build's entry point (``static/remoteEntry.<hash>.js``), which names it.
    Fails, saying how to build, when it is missing or stale and cannot be rebuilt here.
    """
    package = BUILT / "package.json"
    lock = Path(tempfile.gettempdir()) / "nbdist-labextension-build.lock"
    with open(lock, "w") as held:  # one build at a time, for every UI test on this machine
        fcntl.flock(held, fcntl.LOCK_EX)
        newest, which = _newest_source()
        if not package.exists() or package.stat().st_mtime < newest:
            why = "missing" if not package.exists() else f"older than {which}"
            jlpm = shutil.which("jlpm", path=str(Path(sys.executable).parent))
            if not jlpm or not shutil.which("node") or not (SOURCES / "node_modules").is_dir():
                pytest.fail(
                    f"the JupyterLab extension build {BUILT} is {why} and cannot be rebuilt here "
                    "(needs node, jlpm and labextension/node_modules): run "
                    "`cd labextension && jlpm install && jlpm build`"
                )
            began = time.monotonic()
            done = subprocess.run(
                [jlpm, "build"], cwd=SOURCES, capture_output=True, text=True, timeout=600
            )
            if done.returncode:
                pytest.fail(
                    f"`jlpm build` in {SOURCES} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
                )
            print(f"\nrebuilt the JupyterLab extension ({why}) in {time.monotonic() - began:.0f} s")
    return json.loads(package.read_text())["jupyterlab"]["_build"]["load"]


def link_labextension(folder: Path) -> Path:
    """``folder/nbdist`` -> this checkout's build; pass ``folder`` as ``extra_labextensions_path``."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "nbdist"
    if not link.exists():
        link.symlink_to(BUILT, target_is_directory=True)
    return folder


class _ConfigData(html.parser.HTMLParser):
    """The page's ``<script id="jupyter-config-data">`` JSON."""

    def __init__(self):
        super().__init__()
        self.inside = False
        self.text = ""

    def handle_starttag(self, tag, attrs):
        self.inside = tag == "script" and ("id", "jupyter-config-data") in attrs

    def handle_endtag(self, tag):
        self.inside = False

    def handle_data(self, data):
        if self.inside:
            self.text += data


def served_labextension(page_html: str) -> str | None:
    """The entry point of the nbdist extension a JupyterLab (or Notebook 7) page loads."""
    parser = _ConfigData()
    parser.feed(page_html)
    config = json.loads(parser.text or "{}")
    for ext in config.get("federated_extensions", []):
        if ext.get("name") == "nbdist":
            return ext.get("load")
    return None
