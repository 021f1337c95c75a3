"""Kernel side, starting separate processes: the ipyparallel launchers for engines on this machine.

- :class:`ZygoteEngineSetLauncher` starts every engine from one process that
  imported torch once (see ``nbdist.launch.zygote``), with a per-rank environment
  (``CUDA_VISIBLE_DEVICES``, ``LOCAL_RANK``...) fixed before the engine starts.
- :func:`watched_controller_cmd` runs the controller under the parent watchdog
  (:mod:`nbdist.launch.parent_watchdog`), so it exits when the kernel that
  started it dies.

Both are plain ipyparallel launchers: ``Cluster(engine_launcher_class=...)``
drives them, so stop/signal/restart go through ipyparallel's own code paths.
Engines that Slurm, MPI or SSH start are awaited in :mod:`nbdist.launch.remote_engines`.
"""

from __future__ import annotations

import glob
import json
import os
import sys

from ipyparallel.cluster.launcher import LocalEngineLauncher
from traitlets import Dict, Integer, List, Unicode

from nbdist.launch import zygote
from nbdist.launch.batch_task_engine import ENGINE_ARGS

__all__ = ["ZygoteEngineSetLauncher", "watched_controller_cmd"]


def watched_controller_cmd() -> list[str]:
    """The controller command, run under the parent watchdog: it ends when this kernel dies."""
    return [
        sys.executable,
        "-m",
        "nbdist.launch.parent_watchdog",
        str(os.getpid()),
        "ipyparallel.controller",
    ]


class ZygoteEngineSetLauncher(LocalEngineLauncher):
    """Launch a set of engines as forks of one torch-importing process."""

    name = Unicode("nbdist-zygote")

    slot_environments = List(
        Dict(), config=True, help="One environment dict per engine, in slot order."
    )
    threads = Integer(1, config=True, help="torch threads per engine.")
    start_method = Unicode(
        "fork", config=True, help="'fork' (after importing torch) or 'spawn' (separate processes)."
    )

    @property
    def status_file(self) -> str:
        """Where the zygote writes how it started the engines (method, reason, PIDs)."""
        return os.path.join(self.profile_dir, "log", f"{self.identifier}.status.json")

    def start(self, n):
        """Start the zygote, which starts ``n`` engines (one per slot environment)."""
        slots = list(self.slot_environments) or [{} for _ in range(n)]
        if len(slots) != n:
            raise ValueError(f"{n} engines requested but {len(slots)} slot environments given")
        self.n = n
        self.engine_cmd = [
            sys.executable,
            "-m",
            "nbdist.launch.zygote",
            "--slots",
            json.dumps(slots),
            "--parent-pid",
            str(os.getpid()),
            "--threads",
            str(self.threads),
            "--start-method",
            self.start_method,
            "--status-file",
            self.status_file,
            "--",
        ]
        self.engine_args = [*self.engine_args, *ENGINE_ARGS]
        return super().start()

    def read_status(self) -> dict:
        """What the zygote reported: method ('fork'/'spawn'), reason, child pids."""
        try:
            with open(self.status_file) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def get_output(self, remove=False):
        """The engines' output (ipyparallel's); ``remove`` also removes the status file,
        the exit status the zygote kept for each engine it reaped and each engine's crash
        record (faulthandler's file, empty unless it died of a fatal signal)."""
        if remove:
            # In a named profile (--profile) the log folder stays: one exit file per rank
            # and start or restart would pile up there for good.
            records = [
                path
                for kind in zygote.RECORD_KINDS
                for path in glob.glob(glob.escape(self.status_file) + f".{kind}.*")
            ]
            for path in [self.status_file, *records]:
                try:
                    os.remove(path)
                except OSError:
                    pass
        return super().get_output(remove=remove)
