"""Separate process: the parent watchdog, running a Python module that ends itself when its parent dies.

``python -m nbdist.launch.parent_watchdog PARENT_PID MODULE [ARGS...]`` runs ``MODULE`` as
``__main__`` and, from a watcher thread, sends itself SIGTERM once its parent
pid changes (the kernel that started it was killed, even with SIGKILL).
nbdist starts the ipyparallel controller this way, so a killed kernel does not
leave a controller listening. SIGTERM lets the controller stop its own
scheduler processes the normal way.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time

__all__ = ["main"]


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)
    # Still here after the grace period: the module ignored SIGTERM.
    time.sleep(5)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    """``python -m nbdist.launch.parent_watchdog PARENT_PID MODULE [ARGS...]``: run MODULE, die with the parent."""
    if len(sys.argv) < 3:
        sys.exit("usage: python -m nbdist.launch.parent_watchdog PARENT_PID MODULE [ARGS...]")
    parent_pid, module = int(sys.argv[1]), sys.argv[2]
    threading.Thread(target=_watch, args=(parent_pid,), daemon=True).start()
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
