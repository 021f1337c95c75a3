"""Starting a real Jupyter kernel in the tests, again when it lost its ports to another process.

jupyter_client picks a kernel's five TCP ports by binding each to port 0 and closing it; the
kernel binds them itself a second or more later, once it has imported ipykernel. In between,
any process's outgoing connection can get one of them as its local port, and the tests beside
start ranks whose gloo mesh opens thousands: once (CI, night of 2026-12-01, example 07) the
kernel died with "zmq.error.ZMQError: Address already in use" before answering
``kernel_info``. Such a
kernel ran none of the test's code; a user would start it again, and so do these helpers, at
most :data:`TRIES` times. Any other failure, or the same one every time, still fails the test.
"""

from __future__ import annotations

from jupyter_client import KernelManager
from nbclient import NotebookClient

__all__ = ["TRIES", "execute_notebook", "start_kernel"]

TRIES = 3
_DIED_AT_START = "Kernel died before replying to kernel_info"


def _died_at_start(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and _DIED_AT_START in str(exc)


def execute_notebook(nb, **kwargs) -> NotebookClient:
    """``NotebookClient(nb, **kwargs).execute()``; a kernel that died before any cell is started
    again. Returns the client that ran the notebook."""
    for attempt in range(1, TRIES + 1):
        client = NotebookClient(nb, **kwargs)
        try:
            client.execute()
            return client
        except RuntimeError as exc:
            if attempt == TRIES or not _died_at_start(exc):
                raise
    raise AssertionError("unreachable")


def start_kernel(env: dict[str, str] | None, timeout: float):
    """A started ``python3`` kernel and its ready blocking client: ``(manager, client)``.

    ``env``: the kernel's whole environment (None: this process's).
    """
    for attempt in range(1, TRIES + 1):
        km = KernelManager(kernel_name="python3")
        km.start_kernel(**({"env": env} if env else {}))
        kc = km.client()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=timeout)
            return km, kc
        except BaseException as exc:
            kc.stop_channels()
            if km.has_kernel:
                km.shutdown_kernel(now=True)
            else:
                km.cleanup_resources()
            if attempt == TRIES or not _died_at_start(exc):
                raise
    raise AssertionError("unreachable")
