"""Fixtures for the server-extension tests: a real jupyter_server (pytest-jupyter) with nbdist.server.

pytest-jupyter's fixtures are imported here rather than registered as a
plugin, so they (and their isolated JUPYTER_* directories) exist only for
these tests.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_jupyter", reason="pip install 'pytest-jupyter[server]'")

from pytest_jupyter.jupyter_server import *  # noqa: E402, F403

from tests.cluster.conftest import sshd  # noqa: E402, F401 - an sshd on loopback, for SSH ranks


@pytest.fixture
def jp_server_config():
    return {
        "ServerApp": {
            "jpserver_extensions": {"nbdist.server": True},
            # The server's own guard against handlers that forgot @web.authenticated stays
            # off, so a test request without login reaches nbdist's handlers themselves.
            "allow_unauthenticated_access": True,
        }
    }


@pytest.fixture
def history(tmp_path, monkeypatch) -> str:
    """A private run history for the test; kernels the server starts inherit it."""
    path = str(tmp_path / "history.sqlite")
    monkeypatch.setenv("NBDIST_HISTORY", path)
    return path
