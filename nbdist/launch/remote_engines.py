"""Kernel side, starting separate processes: engines that Slurm, MPI or SSH start, awaited.

Usually on other hosts (a one-node Slurm cluster or ``ssh localhost`` counts
too); the engines nbdist forks on this machine start in :mod:`nbdist.launch.local_engines`.
ipyparallel's launchers start the engines; nbdist's classes for them
(:func:`engine_launcher_class`) run :mod:`nbdist.launch.batch_task_engine` where a
scheduler numbers the tasks, and say why a start failed. While the engines
register, :func:`wait_for_engines` watches the launcher itself, so a start
that cannot succeed fails at once with the launcher's words instead of after
``--timeout``:

- a Slurm job: its queue state, printed while it waits
  (``nbdist: waiting for Slurm: job 123 PENDING (Resources) · 12 s``), and an
  error naming how it ended if it ends before its ranks registered;
- ``mpiexec``: an exit before every engine registered, with its output;
- SSH: an engine process that ended, with its output.

Ctrl-C while waiting raises ``KeyboardInterrupt``; the caller stops what
started (the job is cancelled).
"""

from __future__ import annotations

import sys
import time

import psutil
from ipyparallel.cluster.launcher import MPIEngineSetLauncher
from traitlets import default

from nbdist.errors import NbdistError
from nbdist.launch.slurm_job import ENDED_STATES, SlurmEngineJob, check_job
from nbdist.launch.ssh_engines import SSHEngines, check_hosts

__all__ = [
    "MPIEngines",
    "check_before_start",
    "engine_launcher_class",
    "launcher_name",
    "start_note",
    "wait_for_engines",
]

# How often a waiting Slurm job's state is asked for (one squeue call each), and
# how often the waiting line is printed again when nothing changed.
_POLL_S = 1.0
_REPEAT_S = 15.0
_QUIET_S = 3.0


class MPIEngines(MPIEngineSetLauncher):
    """ipyparallel's mpiexec launcher, running :mod:`nbdist.launch.batch_task_engine` (no mpi4py)."""

    @default("engine_cmd")
    def _engine_cmd_default(self):
        return [sys.executable, "-m", "nbdist.launch.batch_task_engine"]

    @property
    def program(self):
        """The task engine; ipyparallel's ``--mpi`` (which imports mpi4py) is not passed."""
        return list(self.engine_cmd)


_CLASSES = {"slurm": SlurmEngineJob, "mpi": MPIEngines, "ssh": SSHEngines}


def engine_launcher_class(name):
    """nbdist's launcher class for 'slurm', 'mpi' or 'ssh'; anything else as given."""
    return _CLASSES.get(name.lower(), name) if isinstance(name, str) else name


def launcher_name(launcher) -> str:
    """'slurm', 'mpi', 'ssh', or the name (or class name) of another launcher."""
    for name, cls in _CLASSES.items():
        if launcher is cls:
            return name
    return launcher if isinstance(launcher, str) else getattr(launcher, "__name__", "ipyparallel")


def check_before_start(launch) -> None:
    """What can be checked before anything starts, for ``launch`` (a ``LaunchPlan``).

    Slurm: would it run the job (``sbatch --test-only``)? SSH: does every host
    let us in and run nbdist? A :class:`~nbdist.errors.PlacementError` if not.
    """
    if launch.engine_launcher == "slurm":
        check_job(launch.config["SlurmEngineSetLauncher"]["batch_template"], launch.n)
    elif launch.engine_launcher == "ssh":
        ssh = launch.config["SSHEngineSetLauncher"]
        check_hosts(
            ssh["engines"],
            python=ssh.get("remote_python", sys.executable),
            ssh_args=ssh.get("ssh_args", []),
        )


def start_note(engines) -> str:
    """What the start line adds about the launcher: 'Slurm job 123' ('' for others)."""
    if isinstance(engines, SlurmEngineJob) and engines.job_id:
        return f"Slurm job {engines.job_id}"
    return ""


def _tail(engines) -> str:
    try:
        text = engines.get_output(remove=False) or ""
    except Exception:  # the log is a courtesy: the failure itself is reported
        return ""
    lines = [line.rstrip() for line in text.strip().splitlines()]
    if len(lines) > 24:
        # The cause is often first (ssh's "Could not resolve hostname"), then a
        # page of advice, then the last words.
        lines = [*lines[:8], "...", *lines[-12:]]
    kept = "\n".join(lines)
    return f"\n--- launcher output ---\n{kept}" if kept else ""


def _ended(engines) -> str:
    """Why the launcher can no longer start the engines ('' while it still can)."""
    process = getattr(engines, "process", None)  # a psutil.Process (mpiexec)
    if process is not None and not _alive(process):
        # The code is known once ipyparallel's own waiting thread has reaped it.
        code = (getattr(engines, "stop_data", None) or {}).get("exit_code")
        return f"{engines.args[0]} exited" + (f" (exit code {code})" if code is not None else "")
    for key, launcher in getattr(engines, "launchers", {}).items():
        if getattr(launcher, "state", "") == "after":
            return f"the engine {key} ended"
    return ""


def _alive(process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _say(text: str) -> None:
    print(f"nbdist: {text}", flush=True)


def wait_for_engines(client, engines, n: int, *, timeout: float) -> None:
    """Return once ``n`` engines registered; NbdistError when the launcher cannot get there.

    ``engines``: the engine-set launcher that started them.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    slurm = engines if isinstance(engines, SlurmEngineJob) else None
    shown, shown_at, next_poll = "", 0.0, 0.0
    state = None
    while len(client.ids) < n:
        now = time.monotonic()
        if slurm is not None and now >= next_poll:
            next_poll = now + _POLL_S
            state = slurm.queue_state()
            if state is None or state[0] in ENDED_STATES:
                how = state[0] if state else slurm.final_state() or "no longer listed by squeue"
                raise NbdistError(
                    f"Slurm job {slurm.job_id} ended ({how}) before its {n} ranks started "
                    f"({len(client.ids)} had registered){_tail(engines)}"
                )
            # Reason "None": submitted a moment ago, the scheduler has not looked yet.
            if state[0] == "PENDING" and (state[1] != "None" or now - t0 >= _QUIET_S):
                line = f"waiting for Slurm: job {slurm.job_id} PENDING ({state[1]})"
                if line != shown or now - shown_at >= _REPEAT_S:
                    _say(f"{line} · {now - t0:.0f} s (Ctrl-C cancels the job)")
                    shown, shown_at = line, now
        elif slurm is None:
            why = _ended(engines)
            if why:
                # A moment for the last registrations of engines that did start.
                time.sleep(0.2)
                if len(client.ids) >= n:
                    return
                raise NbdistError(
                    f"{why} before its {n} ranks started ({len(client.ids)} had "
                    f"registered){_tail(engines)}"
                )
        if now >= deadline:
            where = f"; Slurm job {slurm.job_id} is {state[0]} ({state[1]})" if state else ""
            raise NbdistError(
                f"the {n} ranks did not all start within {timeout:g} s ({len(client.ids)} "
                f"registered{where}): raise --timeout if the machine or queue is busy"
                f"{_tail(engines)}"
            )
        time.sleep(0.1)
