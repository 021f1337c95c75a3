"""Kernel side: the Slurm job behind ``--launcher slurm``: checked, submitted, watched, cancelled.

One job whose tasks are the engines (``srun`` in an ``sbatch`` script, see
:mod:`nbdist.launch.launcher_options` for the script and
:mod:`nbdist.launch.batch_task_engine` for what each task runs):

- before anything starts, :func:`check_job` asks Slurm (``sbatch --test-only``)
  whether it would run it: a partition, account or size Slurm refuses is a
  :class:`~nbdist.errors.PlacementError` in Slurm's own words, and nothing is queued;
- while the ranks are awaited, :meth:`SlurmEngineJob.state` says where the job
  is (``PENDING (Resources)``, ``RUNNING``, gone);
- :meth:`SlurmEngineJob.stop` cancels it and returns once ``squeue`` no longer
  lists it.

Example (a one-node cluster started by ``scripts/slurm_local.sh start``)::

    >>> nodes_here("debug")  # doctest: +SKIP
    True
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from ipyparallel.cluster.launcher import SlurmEngineSetLauncher
from traitlets import default

from nbdist.errors import NbdistError, PlacementError
from nbdist.launch.hosts import is_this_machine

__all__ = [
    "ENDED_STATES",
    "SlurmEngineJob",
    "check_job",
    "loopback_will_do",
    "nodes_here",
    "slurm_command",
]

# squeue's states of a job that will not run (again) by itself.
ENDED_STATES = frozenset(
    "BOOT_FAIL CANCELLED COMPLETED DEADLINE FAILED NODE_FAIL OUT_OF_MEMORY PREEMPTED "
    "TIMEOUT".split()
)
# How long stop() waits for the cancelled job to leave the queue (its tasks get
# SIGTERM, then SIGKILL after the cluster's KillWait).
_STOP_WAIT_S = 60.0
# How long the engines get to end on SIGTERM before the job is cancelled.
_STEP_WAIT_S = 3.0


def slurm_command(args: list[str], *, env=None, timeout: float = 30.0):
    """Run a Slurm client command; its CompletedProcess (text). A missing command is
    a :class:`~nbdist.errors.PlacementError` naming it."""
    try:
        return subprocess.run(
            args, capture_output=True, text=True, env=env, timeout=timeout, check=False
        )
    except FileNotFoundError:
        raise PlacementError(
            f"--launcher slurm needs Slurm's {args[0]!r} on this machine's PATH (not found): "
            "run the notebook on a Slurm login node, or try a local one with "
            "`bash scripts/slurm_local.sh start`"
        ) from None
    except subprocess.TimeoutExpired:
        raise NbdistError(
            f"`{' '.join(args)}` did not answer within {timeout:g} s: is slurmctld up? "
            "(`scontrol ping` says)"
        ) from None


def nodes_here(partition: str | None) -> bool | None:
    """Whether every node of ``partition`` (None: the default one) is this machine.

    None where Slurm cannot tell (no ``sinfo``, no such partition): the
    submission then says what is wrong, in Slurm's words.
    """
    args = ["sinfo", "-h", "-N", "-o", "%N %o"] + (["-p", partition] if partition else [])
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.split() for line in result.stdout.splitlines() if line.strip()]
    if result.returncode != 0 or not lines:
        return None
    return all(any(is_this_machine(name) for name in line) for line in lines)


def loopback_will_do(partition: str | None) -> bool:
    """Engines of a job in ``partition`` reach a controller on loopback: its nodes (or,
    for a partition Slurm does not know, every node of the cluster) are this machine."""
    here = nodes_here(partition)
    if here is None and partition:
        here = nodes_here(None)  # submitting names the unknown partition, in Slurm's words
    return bool(here)


def check_job(template: str, n: int) -> None:
    """Ask Slurm (``sbatch --test-only``) whether it would run the job of ``template``.

    Nothing is queued. A partition, account, time or size Slurm refuses is a
    :class:`~nbdist.errors.PlacementError` in Slurm's own words.
    """
    from IPython.utils.text import EvalFormatter  # what ipyparallel formats the script with

    script = EvalFormatter().format(
        template,
        n=n,
        cluster_id="nbdist-check",
        program_and_args="true",
        output_file="/dev/null",
        queue="",
        profile_dir="",
    )
    with tempfile.NamedTemporaryFile("w", prefix="nbdist-check-", suffix=".sbatch") as f:
        f.write(script)
        f.flush()
        trial = slurm_command(["sbatch", "--test-only", f.name])
    if trial.returncode != 0:
        raise PlacementError(
            f"Slurm would not run the job of {n} ranks: "
            f"{_slurm_words(trial.stderr + trial.stdout)}. Nothing was submitted: change "
            "--partition/--account/--time (or the launcher options) to ones this cluster "
            "accepts (`sinfo` lists the partitions)"
        )


def _slurm_words(text: str) -> str:
    """Slurm's error lines, without the 'sbatch: error:' prefixes."""
    lines = []
    for line in text.strip().splitlines():
        line = line.strip()
        for prefix in ("sbatch: error: ", "sbatch: ", "allocation failure: "):
            if line.startswith(prefix):
                line = line[len(prefix) :]
                break
        if line and line not in lines:
            lines.append(line)
    return "; ".join(lines) or "no message"


class SlurmEngineJob(SlurmEngineSetLauncher):
    """ipyparallel's Slurm engine launcher, with nbdist's task engine and clear errors.

    Differences: each task runs :mod:`nbdist.launch.batch_task_engine` (engine id =
    ``SLURM_PROCID``); the batch script goes to the profile's log directory,
    not the notebook's; Slurm's error text reaches the exception; ``stop``
    waits until the job has left the queue and tolerates a job that already ended.
    """

    @default("engine_cmd")
    def _engine_cmd_default(self):
        return [sys.executable, "-m", "nbdist.launch.batch_task_engine"]

    def __init__(self, *args, **kwargs):
        """As ipyparallel's; the batch script is kept with the profile's logs."""
        super().__init__(*args, **kwargs)
        log_dir = os.path.join(self.profile_dir, "log")
        os.makedirs(log_dir, exist_ok=True)
        self.batch_file = os.path.join(log_dir, f"{self.identifier}.sbatch")

    def _run_command(self, command, **kwargs):
        result = slurm_command(list(command), env=kwargs.get("env"))
        if result.returncode != 0:
            raise PlacementError(
                f"Slurm refused `{command[0]}`: {_slurm_words(result.stderr + result.stdout)}"
            )
        return result.stdout

    def queue_state(self) -> tuple[str, str] | None:
        """(state, reason) as squeue shows them, e.g. ('PENDING', 'Resources'); None once gone."""
        if not self.job_id:
            return None
        result = slurm_command(["squeue", "-h", "-j", self.job_id, "-o", "%T|%r"])
        line = result.stdout.strip()
        if result.returncode != 0 or not line:
            return None
        state, _, reason = line.partition("|")
        return state, reason

    def final_state(self) -> str:
        """How the job ended, from ``scontrol`` while Slurm still remembers it ('' if not)."""
        result = slurm_command(["scontrol", "-o", "show", "job", self.job_id])
        fields = dict(item.split("=", 1) for item in result.stdout.split() if "=" in item)
        state = fields.get("JobState", "")
        reason = fields.get("Reason", "None")
        return f"{state} ({reason})" if reason not in ("None", "") else state

    def _wait_gone(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.queue_state() is not None and time.monotonic() < deadline:
            time.sleep(0.1)

    def stop(self):
        """Cancel the job; return once squeue no longer lists it (a job already gone is fine)."""
        output = ""
        if self.job_id:
            # The engines (step 0's tasks) first, so that srun and then the batch
            # script end by themselves: cancelling the job at once kills srun first,
            # and each task's slurmstepd then retries telling it for 5 s.
            slurm_command(["scancel", "--signal=TERM", f"{self.job_id}.0"])
            self._wait_gone(_STEP_WAIT_S)
            result = slurm_command(["scancel", self.job_id])
            output = (result.stdout + result.stderr).strip()
            self._wait_gone(_STOP_WAIT_S)
        self.notify_stop(dict(job_id=self.job_id, output=output))
        return output
