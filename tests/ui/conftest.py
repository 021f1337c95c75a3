"""Fixtures for the real-browser tests: a JupyterLab server and a headless Chromium page.

Everything is real and isolated: ``python -m jupyterlab`` on a free loopback
port with a random token, its own JUPYTER_*_DIR / IPYTHONDIR / settings dirs,
and Debian's Chromium (``/usr/bin/chromium``) driven by Playwright with a new,
empty profile. Tests skip (saying why) when Chromium or Playwright is missing;
``scripts/install_browser.sh`` installs both.

The JupyterLab extension under test is this checkout's build (``nbdist/labextension``),
rebuilt first when its sources (``labextension/``) are newer: a venv also holds an
installed copy (``share/jupyter/labextensions/nbdist``, from the last ``pip install``),
which JupyterLab would otherwise find first. Every server gets the build on
``LabApp.extra_labextensions_path`` (searched before every other folder), and
:func:`served_labextension` checks that the page loads exactly that build.

Teardown shuts the kernels down through the REST API, then the server, and
fails if any process the server started (sampled during the test, so
reparented ones count too) or the browser is still alive.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import wait_gone
from tests.ui.lab import LabServer, start_lab, stop_lab
from tests.ui.labbuild import BUILT, labextension_build, link_labextension, served_labextension

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts" / "ui"


def notebook_json(cells: list[str]) -> dict:
    """A notebook (nbformat 4 JSON) of code cells on the python3 kernel, without outputs."""
    return {
        "cells": [
            {
                "cell_type": "code",
                "execution_count": None,
                "id": f"cell-{i}",
                "metadata": {},
                "outputs": [],
                "source": source,
            }
            for i, source in enumerate(cells)
        ],
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def poll(fn, timeout: float, interval: float = 0.1):
    """``fn()``'s first truthy value within ``timeout`` seconds, else its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def on_current_view(action, timeout: float = 30):
    """``action()``'s value, retried while the element it acts on is replaced under it.

    A dashboard shown with ``display_id`` is rebuilt by the browser on each
    ``update_display_data`` (after a cell that logged, or the run's end): an element
    located just before such an update is detached by the time the action runs ("not
    attached to the DOM"), or while a screenshot waits for it to be stable (Playwright then
    finds it "not visible"), and the action is tried again on the rebuilt view. Any other
    error is raised.
    """
    from playwright.sync_api import Error

    replaced = ("not attached to the DOM", "Node is either not visible or not an HTMLElement")
    deadline = time.monotonic() + timeout
    while True:
        try:
            return action()
        except Error as error:
            if not any(words in str(error) for words in replaced):
                raise
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


def drawn(graph, expression: str, timeout: float = 30):
    """``expression`` (JavaScript: a function of a Plotly graph div) once plotly has drawn
    the div ``graph`` locates, polled until truthy: ``_fullData`` and ``_fullLayout`` are
    there only after a draw, and the next draw of a live dashboard starts without them."""
    script = f"d => (d._fullData && d._fullLayout) ? ({expression})(d) : null"
    return poll(lambda: on_current_view(lambda: graph.evaluate(script)), timeout, interval=0.2)


def attached(element, expression: str, timeout: float = 30):
    """``expression`` (JavaScript: a function of the element ``element`` locates) evaluated
    on an element still attached to the page.

    Playwright finds the element, then calls the function: a dashboard view rebuilt in
    between (``update_display_data``) hands the function a detached element, whose computed
    styles are all empty strings and whose sizes are zero. Such a call is retried on the
    rebuilt view.
    """
    script = f"e => e.isConnected ? [({expression})(e)] : null"
    value = poll(lambda: on_current_view(lambda: element.evaluate(script)), timeout, interval=0.2)
    assert value is not None, f"the element stayed detached for {timeout} s: {element}"
    return value[0]


def _require_browser() -> None:
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: run scripts/install_browser.sh")
    if importlib.util.find_spec("playwright") is None:
        pytest.skip("playwright is not installed: run scripts/install_browser.sh")
    if importlib.util.find_spec("jupyterlab") is None:
        pytest.fail("playwright is installed but jupyterlab is not: run scripts/install_browser.sh")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    # Keep each phase's report on the item, so fixtures can tell a failed test in teardown.
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def labextension_entry() -> str:
    """This checkout's extension build (rebuilt if stale); its entry point names it."""
    _require_browser()
    return labextension_build()


@pytest.fixture
def lab_factory(tmp_path, artifacts_dir, labextension_entry):
    """``start(notebook_name, nb_json)``: a running JupyterLab with that notebook in its root.

    The server loads this checkout's extension build; the fixture fails if its page
    would load any other.
    """
    started: list[LabServer] = []

    def start(name: str, notebook: dict) -> LabServer:
        root = tmp_path / "root"
        root.mkdir(exist_ok=True)
        (root / name).write_text(json.dumps(notebook, indent=1))
        labextensions = link_labextension(tmp_path / "labextensions-under-test")
        server = start_lab(
            tmp_path / "jupyter", root, artifacts_dir / "jupyter-server.log", labextensions
        )
        started.append(server)
        status, page = server.get(f"lab?token={server.token}")
        served = served_labextension(page.decode()) if status == 200 else None
        if served and server.get(f"lab/extensions/nbdist/{served}")[0] != 200:
            served = f"{served} (named by the page, but not served)"
        if served != labextension_entry:
            pytest.fail(
                f"JupyterLab serves the nbdist extension {served!r}, not this checkout's build "
                f"{labextension_entry!r} ({BUILT})"
            )
        return server

    yield start
    problems = []
    for server in started:
        began = time.monotonic()
        problems += stop_lab(server)
        print(
            f"\nJupyterLab teardown: {len(server.sampler.seen)} processes it started tracked, "
            f"{time.monotonic() - began:.1f} s"
        )
    if problems:
        pytest.fail("JupyterLab teardown:\n" + "\n".join(problems))


@pytest.fixture
def browser_page(request, tmp_path, artifacts_dir):
    """A Playwright page in headless Debian Chromium with a new, empty profile.

    When the test fails, the page is saved as ``artifacts/ui/failed-<test>.png``.
    """
    _require_browser()
    from playwright.sync_api import sync_playwright

    os.environ["PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD"] = "1"
    before = {p.pid for p in psutil.Process().children()}
    pw = sync_playwright().start()
    # Playwright's driver (a node process) is our new child; Chromium runs under it.
    drivers = [p for p in psutil.Process().children() if p.pid not in before]
    context = pw.chromium.launch_persistent_context(
        user_data_dir=str(tmp_path / "chromium-profile"),
        executable_path=CHROMIUM,
        headless=True,
        args=CHROMIUM_FLAGS,
        viewport={"width": 1400, "height": 1000},
    )
    page = context.pages[0] if context.pages else context.new_page()
    try:
        yield page
    finally:
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            try:
                page.screenshot(path=str(artifacts_dir / f"failed-{request.node.name}.png"))
            except Exception as exc:  # the page may be gone: keep tearing down
                print(f"no failure screenshot: {exc}")
        pids = set()
        for driver in drivers:
            pids.add(driver.pid)
            try:
                pids.update(c.pid for c in driver.children(recursive=True))
            except psutil.Error:
                pass
        context.close()
        pw.stop()
        left = wait_gone(sorted(pids), timeout=10)
        if left:
            for pid in left:
                try:
                    psutil.Process(pid).kill()  # ours, by PID
                except psutil.Error:
                    pass
            pytest.fail(f"browser processes outlived the test: {left}")
