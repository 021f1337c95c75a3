"""Fixtures of the debugging tests (kernel side, driving real kernels and ranks)."""

from __future__ import annotations

import pytest

from tests.debugging.test_lab_debugger import LabDebugClient
from tests.notebooks.conftest import Kernel


@pytest.fixture(scope="module")
def lab():
    """A real kernel with 2 ranks and a client speaking JupyterLab's debug protocol to it."""
    kernel = Kernel()
    try:
        kernel.start_dist(2)
        yield kernel, LabDebugClient(kernel)
    finally:
        kernel.shutdown()
