"""Kernel side: ipyparallel's one-time serializer set-up, paid on a thread while engines start.

The first ``apply`` of a process imports numpy (ipyparallel registers how to send
arrays): 0.17 s, which used to fall between "engines registered" and "group formed".
:func:`warm_serializer` starts it once the controller is up (:mod:`nbdist.launch.cluster`),
while the engines still import torch; :func:`serializer_ready` waits for it before the
first ``apply`` (:mod:`nbdist.driver.group`), since that set-up is not thread-safe.
"""

from __future__ import annotations

import threading

__all__ = ["serializer_ready", "warm_serializer"]

_warm_thread: threading.Thread | None = None


def warm_serializer() -> None:
    """Start the set-up on a thread (once); :func:`serializer_ready` waits for it."""
    global _warm_thread
    if _warm_thread is None:
        _warm_thread = threading.Thread(target=_import_serializer, name="nbdist-warm", daemon=True)
        _warm_thread.start()


def serializer_ready() -> None:
    """Wait for :func:`warm_serializer` (if it was started) to finish."""
    if _warm_thread is not None:
        _warm_thread.join()


def _import_serializer() -> None:
    try:
        from ipyparallel.serialize import canning

        canning.can(None)  # the first call imports the types named in its mapping
    except Exception:  # an optional head start: the first apply does it anyway
        pass
