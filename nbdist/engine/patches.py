"""Rank side: every patch nbdist makes to torch, the standard library and the engine kernel, in one list.

A rank is an ordinary torchrun-style process, but a few functions behave
differently there, each for a reason a user meets sooner or later: a script's
own ``init_process_group`` must find nbdist's group, ``input()`` must reach the
notebook, a hang must say which collective each rank is in. Each patch lives in
its own module (what it does and why is explained there); :data:`PATCHES`
lists them all, in the order they go in, with what each wraps, why and how to
turn it off, and this module is the one place that installs them:

- :func:`install_on_group` each time the process group forms (a rejoin too);
- :func:`install_on_rank` once the rank joined it (and the engine kernel's
  patches where there is one);
- :func:`install_in_script` in a script ``%dist_export`` wrote, under torchrun.

Every ``install`` is idempotent: installing twice wraps nothing twice. Each
wrapper keeps the function it replaced (``nbdist_original``, or
``nbdist_plain`` for p2p staging and the execute reply).

Not patches, and so not listed: the environment a rank gets (torchrun's,
:mod:`nbdist.engine.torchrun_env`; ``TORCH_FR_BUFFER_SIZE`` from
:mod:`nbdist.engine.flight_recorder`, kept when the user sets one) and the
profiler's hook in ``nbdist.log``'s own step hooks.

Example (on a rank)::

    >>> from nbdist.engine import patches
    >>> [p.name for p in patches.PATCHES if p.stage == "group"]
    ['p2p_staging', 'functional_gather', 'gpu_like', 'collectives', 'user_group', 'control.track_subgroups']
"""

from __future__ import annotations

from dataclasses import dataclass

from nbdist.engine import (
    cell_reply,
    child_output,
    collectives,
    control,
    exit_refusal,
    functional_gather,
    gpu_like,
    late_interrupt,
    launcher_refusal,
    p2p_staging,
    rank_names,
    stdin_bridge,
    traceback_once,
    traceback_trim,
    user_group,
)
from nbdist.metrics import log as metrics_log

__all__ = ["PATCHES", "Patch", "install_in_script", "install_on_group", "install_on_rank"]


@dataclass(frozen=True)
class Patch:
    """One patch: the function that installs it, when, what it wraps, why, how to turn it off."""

    name: str  # ``module`` (its ``install``) or ``module.function``, in nbdist.engine
    stage: str  # "group": each formation; "rank": once joined; "kernel": with an engine kernel
    wraps: str
    why: str
    turn_off: str


# In install order within each stage. p2p staging goes before the collectives wrapper,
# which then counts the staged send/recv like any other collective.
PATCHES: tuple[Patch, ...] = (
    Patch(
        "p2p_staging",
        "group",
        wraps="torch.distributed send, recv, isend, irecv, batch_isend_irecv (and "
        "distributed_c10d's isend/irecv): CUDA tensors copied through host memory",
        why="gloo with CUDA tensors (ranks sharing a GPU, NCCL < 2.30) breaks the whole "
        "group on a send/recv of a CUDA tensor",
        turn_off="only installed for gloo on CUDA, where it cannot be done without (and for "
        "CPU tensors too with NBDIST_GPU_LIKE=1)",
    ),
    Patch(
        "functional_gather",
        "group",
        wraps="nothing of torch's in Python: a CUDA kernel (torch.library) for the functional "
        "all-gather operators (_c10d_functional.all_gather_into_tensor, _out, _coalesced) "
        "that runs the c10d all-gather",
        why="gloo with CUDA tensors (ranks sharing a GPU, NCCL < 2.30) dies of a segmentation "
        "fault in torch's functional all-gather: DTensor full_tensor, tensor/sequence "
        "parallel, full state dicts",
        turn_off="only installed for gloo on CUDA (and for CPU tensors too with NBDIST_GPU_LIKE=1)",
    ),
    Patch(
        "gpu_like",
        "group",
        wraps="nothing of torch's: a global optimizer step pre-hook (torch.optim's own "
        "register_optimizer_step_pre_hook) sets foreach=True where a group left it to torch",
        why="CPU tests take GPU ranks' code paths: foreach kernels (which refuse DTensors mixed "
        "with plain tensors) and point-to-point staged through host memory",
        turn_off="only installed with NBDIST_GPU_LIKE=1 in the ranks' environment (tests)",
    ),
    Patch(
        "collectives",
        "group",
        wraps="torch.distributed's collectives (TRACKED_OPS; isend and irecv in "
        "distributed_c10d too): each call counted and timed",
        why="%dist_where and a cell's --timeout name the collective each rank is in; the "
        "step breakdown's comm_s",
        # ~1 us per call; a user timing single collectives could want a switch (there is none).
        turn_off="no switch; dist.<op>.nbdist_original is torch's own function",
    ),
    Patch(
        "user_group",
        "group",
        wraps="torch.distributed init_process_group and destroy_process_group (and "
        "distributed_c10d's)",
        why="a torchrun script's own init finds nbdist's group up; its destroy leaves the "
        "group up for the next cell",
        turn_off="no switch; user_group.original(name) is torch's own function",
    ),
    Patch(
        "control.track_subgroups",
        "group",
        wraps="torch.distributed.distributed_c10d._new_process_group_helper: the sockets "
        "of each new_group / DeviceMesh group remembered",
        why="%dist_release shuts down a gloo group's sockets, subgroups' included",
        turn_off="no switch; it only records socket numbers",
    ),
    Patch(
        "launcher_refusal",
        "rank",
        wraps="torch.multiprocessing spawn/start_processes, torch's elastic launch_agent, "
        "accelerate's notebook_launcher/debug_launcher (at its import), the _Popen of "
        "multiprocessing's spawn and forkserver processes",
        why="those launchers would start ranks of their own inside a rank (a hang, "
        "orphans); a spawned child cannot import a function defined in a cell",
        turn_off="with nbdist.engine.launcher_refusal.allow_launchers(): ... (this thread, "
        "this block)",
    ),
    Patch(
        "control",
        "kernel",
        wraps="the engine kernel's control handlers: one added (nbdist_request)",
        why="where / release / gpu answered while the rank is busy or hangs",
        turn_off="no switch; it only adds a message type",
    ),
    Patch(
        "late_interrupt",
        "kernel",
        wraps="the engine kernel's pre_handler_hook and post_handler_hook (which request "
        "runs; during it, request_sigint's handler instead of Python's own); between "
        "requests, SIGINT's SIG_IGN by a handler that notes the time",
        why="a Ctrl-C relayed before a rank began the request (in flight, or at many ranks "
        "the last to begin) was ignored there, and the rank ran the whole request; one "
        "landing in the engine's own code lost the reply or ended the engine",
        turn_off="no switch; the wrapped hooks are kept as nbdist_original",
    ),
    Patch(
        "stdin_bridge",
        "kernel",
        wraps="the engine kernel's raw_input and getpass (builtins.input, getpass.getpass "
        "in a cell), pdb.Pdb (replaced by RankPdb), one control handler",
        why="input(), getpass and pdb on a rank ask the notebook; Ctrl-C stays nbdist's "
        "interrupt at a pdb prompt",
        turn_off="no switch; stdin_bridge.RankPdb's base class is the standard pdb.Pdb",
    ),
    Patch(
        "exit_refusal",
        "kernel",
        wraps="the engine shell's ask_exit (what exit() and quit() call); IPython's "
        "\"To exit: use 'exit', 'quit', or Ctrl-D.\" warning after sys.exit, filtered out",
        why="exit() in a cell ended the rank's process and the process group: every rank's "
        "state lost to a %dist_restart; now it fails the cell and the rank runs on",
        turn_off="no switch; shell.ask_exit.nbdist_original is ipykernel's own",
    ),
    Patch(
        "rank_names",
        "kernel",
        wraps="the engine shell's reset (what %reset calls): the rank's names put back after it",
        why="%reset -f on the ranks cleared torch, dist, rank, world_size, device and nbdist "
        "too, and every later cell using them failed with a NameError",
        turn_off="no switch; shell.reset.nbdist_original is IPython's own",
    ),
    Patch(
        "traceback_trim",
        "kernel",
        wraps="the engine shell's showtraceback (a cell's and an apply's errors): the "
        "traceback cut before nbdist's SIGINT handler and debugpy's frames",
        why="every interrupted cell's traceback ended in request_sigint.py's raise, read as "
        "nbdist's own error; a rank paused in the debugger, interrupted, spent 2.5 CPU-s "
        "highlighting debugpy's frames",
        turn_off="no switch; shell.showtraceback.nbdist_original is IPython's own",
    ),
    Patch(
        "traceback_once",
        "kernel",
        wraps="the engine shell's _showtraceback and _format_exception_for_storage: the "
        "traceback just shown is what IPython's history keeps of that exception",
        why="IPython 9 formatted every failed cell's traceback twice, half of what an error "
        "cost a rank: seconds when 64 or 256 ranks on a few cores fail together",
        turn_off="no switch; shell._format_exception_for_storage.nbdist_original is IPython's own",
    ),
    Patch(
        "child_output",
        "kernel",
        wraps="nothing: the engine's IO-pub thread opens ipykernel's pipe for forked children "
        "(a loopback port, as Jupyter's own kernel does)",
        why="what a rank's forked children printed (DataLoader workers, multiprocessing's fork "
        "processes) was lost: their stream sent on a zmq socket a fork cannot use",
        turn_off="no switch; without the pipe (its port not bound) children's prints are lost",
    ),
    Patch(
        "cell_reply",
        "kernel",
        wraps="the engine kernel's do_execute: each execute reply carries the rank's "
        "end-of-cell answer",
        why="the kernel learns how many nbdist.log points to wait for without a user "
        "expression per cell",
        turn_off="no switch; without it the kernel asks with a user expression (slower)",
    ),
)


def install_on_group(*, stage_p2p: bool, gloo_for_nccl: str = "") -> None:
    """The ``group`` patches, each time the process group forms (a rejoin too).

    ``stage_p2p``: the group is gloo with CUDA tensors. ``gloo_for_nccl``: why gloo
    stands in for NCCL here ('' where it does not).
    """
    gpu_like_paths = gpu_like.requested()
    if stage_p2p or gpu_like_paths:
        # NBDIST_GPU_LIKE=1: CPU tensors staged as CUDA tensors would be on gloo.
        p2p_staging.install(stage_cpu_tensors=gpu_like_paths)
        functional_gather.install(cpu_tensors=gpu_like_paths)
    if gpu_like_paths:
        gpu_like.install()
    collectives.install()
    user_group.install(gloo_for_nccl=gloo_for_nccl)
    control.track_subgroups()


def install_on_rank(kernel=None, shell=None) -> None:
    """The ``rank`` patches, then, given the engine's ``kernel`` and ``shell``, the ``kernel`` ones."""
    launcher_refusal.install()
    if kernel is not None:
        # Answered on the engine's control thread, also while a cell runs or hangs.
        control.install(kernel)
        # A SIGINT that came before the request it was meant for still stops it.
        late_interrupt.install(kernel)
        # input(), getpass and pdb on this rank ask the notebook (Jupyter's stdin channel).
        stdin_bridge.install(kernel)
        # What the rank's forked children print (DataLoader workers) reaches the notebook.
        child_output.install(kernel)
        # Each execute reply says what the kernel needs to know after a cell.
        cell_reply.install(kernel, shell)
    if shell is not None:
        # exit() and quit() fail the cell instead of ending the rank and the group.
        exit_refusal.install(shell)
        # %reset clears the user's names, not the rank's own (rank, dist, ...).
        rank_names.install(shell)
        # Tracebacks end at the user's code (not in nbdist's SIGINT handler or debugpy).
        traceback_trim.install(shell)
        # ... formatted once: IPython's history keeps the traceback the notebook was sent.
        traceback_once.install(shell)
        callbacks = shell.events.callbacks.get("pre_execute", [])
        # A collective is known to be this cell's or an earlier one's (a release's rule);
        # a cell's first point does not take the pause since the last cell as its step.
        for began in (collectives.cell_started, metrics_log.new_cell):
            if began not in callbacks:
                shell.events.register("pre_execute", began)


def install_in_script(*, stage_p2p: bool, gloo_for_nccl: str = "") -> None:
    """What a script under torchrun gets: p2p staging where its group needs it, and the
    ``user_group`` wrappers.

    The script's cells ran on ranks where their own ``init_process_group`` found nbdist's
    group up and their ``destroy_process_group()`` left it up for the next cell; in the
    script, whose start formed the group already, they behave the same
    (:func:`nbdist.engine.standalone.finish` ends the group). Launchers are the script's business.
    """
    if stage_p2p:
        p2p_staging.install()
        functional_gather.install()
    user_group.install(gloo_for_nccl=gloo_for_nccl)
