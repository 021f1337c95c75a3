"""Kernel side: ipyparallel's one-time serializer set-up, paid on a thread while engines start.

The first ``apply`` of a process imports numpy (ipyparallel registers how to
send arrays): 0.17 s, which used to fall between "engines registered" and
"group formed". :func:`warm_serializer` starts it once the controller is up;
:func:`serializer_ready` waits for it before the first ``apply``.
"""

from __future__ import annotations

import threading

__all__ = ["serializer_ready", "warm_serializer"]

_warm_thread: threading.Thread | None = None


def warm_serializer() -> None:
    """Pay ipyparallel's one-time serializer set-up now, on a thread, while engines start.

    The first ``apply`` of a process imports numpy (ipyparallel registers how to
    send arrays): 0.17 s, which used to fall between "engines registered" and
    "group formed". Started once the controller is up, it runs while the engines
    are still importing torch. That set-up is not thread-safe: call
    :func:`serializer_ready` before the first ``apply``.
    """
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
