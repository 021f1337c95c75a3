"""Separate process: the batch-task engine, an ipyparallel engine started as one task of a Slurm job or an MPI run.

``srun`` (Slurm) or ``mpiexec`` (Open MPI, MPICH) start this module once per
task; the scheduler numbers the tasks. The engine asks the controller for that
number as its engine id, so the kernel numbers the ranks as the scheduler did
(host by host, engines by id: rank == ``SLURM_PROCID``), and ``LOCAL_RANK``
is the scheduler's local task number, as torchrun's would be.

Without ``mpi4py``: ipyparallel's own ``--mpi`` flag (which imports it) is
dropped, the numbers come from the environment the launcher sets. SIGTERM
(``scancel``, a time limit, ``%dist_stop``) ends the engine at once, even in
the middle of a cell.

Run as ``python -m nbdist.launch.batch_task_engine [ipengine arguments]``.
"""

from __future__ import annotations

import os
import signal
import sys

from nbdist.engine.crash_record import remove_own_record

__all__ = ["ENGINE_ARGS", "NO_SELF_SHUTDOWN", "task_numbers"]

# ipyparallel's engine stops itself after 50 checks (50 x 550 ms at nbdist's heartbeat
# period) without a ping from the controller. With 256 ranks on 2 cores, every process
# runnable while the ranks formed their group, the controller's heart process went
# unscheduled for up to 27 checks in a row (engine logs, 2026-12-01), and once 10 ranks
# ended themselves ("exited with code 1") in the first cell although the controller was
# alive. Ranks end when it is gone by other means: the zygote's forks with their kernel
# (PR_SET_PDEATHSIG, the zygote's watch), a launcher's through
# nbdist.engine.controller_watch, which probes the controller's port from a thread of its
# own. Every engine nbdist starts gets this (the SSH launcher's too).
NO_SELF_SHUTDOWN = "--IPEngine.max_heartbeat_misses=0"
# What the engines nbdist starts without ipyparallel's own command get (these tasks and
# the zygote's forks): no nanny process per engine (the kernel watches the engine's PID,
# or the controller its heartbeat; a nanny adds a process and ~0.5 s to each
# registration), and no input history (every rank would write each cell to SQLite).
ENGINE_ARGS = (
    "--IPEngine.enable_nanny=False",
    "--HistoryManager.enabled=False",
    NO_SELF_SHUTDOWN,
)

# (rank, local rank) variables, by launcher: Slurm, Open MPI, MPICH/Hydra (and Intel MPI).
_SOURCES = (
    ("SLURM_PROCID", "SLURM_LOCALID"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "MPI_LOCALRANKID"),
)


def task_numbers(environ=os.environ) -> tuple[int, int] | None:
    """This task's (rank, local rank) from the launcher's environment; None outside one.

    Example::

        >>> task_numbers({"SLURM_PROCID": "3", "SLURM_LOCALID": "1"})
        (3, 1)
        >>> task_numbers({}) is None
        True
    """
    for rank_var, local_var in _SOURCES:
        if rank_var in environ:
            rank = int(environ[rank_var])
            return rank, int(environ.get(local_var, rank))
    return None


def main(argv: list[str]) -> None:
    """Start the engine with the task's number as its engine id."""
    args = [a for a in argv if a != "--mpi"]
    numbers = task_numbers()
    if numbers is not None:
        rank, local_rank = numbers
        os.environ["LOCAL_RANK"] = str(local_rank)
        args.append(f"--IPEngine.id={rank}")
    args += ENGINE_ARGS
    from ipyparallel.engine.app import IPEngine

    class TaskEngine(IPEngine):
        def init_signal(self):
            super().init_signal()
            # ipyparallel stops on SIGTERM through its event loop, which waits for
            # the running cell; from a scheduler, SIGTERM means the job ends now
            # (cancelled, out of time), and the kernel is told at once that the
            # rank died (instead of after the scheduler's SIGKILL).
            signal.signal(signal.SIGTERM, _end_now)

    sys.argv = [sys.argv[0], *args]
    TaskEngine.launch_instance()


def _end_now(signum, frame) -> None:
    try:  # ended, not crashed: its crash record has nothing to tell
        remove_own_record()
    finally:  # whatever happened there, the scheduler's SIGTERM ends the rank
        os._exit(128 + signum)


if __name__ == "__main__":
    main(sys.argv[1:])
