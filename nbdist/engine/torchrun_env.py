"""Rank side: make each rank look like a process torchrun started, to code written for torchrun.

A script or library written for ``torchrun`` reads its environment contract
(RANK, LOCAL_RANK, WORLD_SIZE, TORCHELASTIC_RUN_ID, ...), parses ``sys.argv``,
calls ``init_process_group`` and, at the end, ``destroy_process_group``; some
refuse to run where ``sys.ps1`` says the interpreter is interactive. On a rank
nbdist already formed the group, the engine's command line is in ``sys.argv``,
and the IPython kernel set ``sys.ps1``. This module gives such code what
torchrun would (see :func:`torchrun_environment`, taken from torch's
``LocalElasticAgent``), and lets its own group calls meet nbdist's group
(:mod:`nbdist.engine.user_group`).

Example::

    >>> env = torchrun_environment(rank=1, local_rank=1, world_size=2, local_world_size=2,
    ...     group_rank=0, group_world_size=1, master_addr="127.0.0.1", master_port=29500,
    ...     run_id="nbdist-1a2b")
    >>> env["TORCHELASTIC_RUN_ID"], env["ROLE_RANK"], env["GROUP_RANK"]
    ('nbdist-1a2b', '1', '0')
"""

from __future__ import annotations

import os
import sys

__all__ = ["CELL_ARGV", "apply", "not_interactive", "torchrun_environment"]

# What sys.argv holds while a cell runs: `python -c` has it, and argparse
# accepts it (the engine's own command line made a script's argparse exit 2).
CELL_ARGV = ["-c"]


def torchrun_environment(
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    group_rank: int,
    group_world_size: int,
    master_addr: str,
    master_port: int,
    run_id: str,
) -> dict[str, str]:
    """The variables torchrun (torch's ``LocalElasticAgent``) sets on each worker, as strings.

    One role ("default") spans every rank, so ROLE_RANK is RANK; a "group" is
    a host (GROUP_RANK: its index, hosts in rank order). Left out on purpose:
    TORCH_NCCL_ASYNC_ERROR_HANDLING, which torchrun sets to 1 (end the process
    on an NCCL error or timeout): nbdist keeps a hung rank alive to show where
    it waits, and torch's own default applies unless you set it.
    """
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(group_rank),
        "GROUP_WORLD_SIZE": str(group_world_size),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        # Rank 0 runs the store itself, as a torchrun worker without the agent's store does.
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


def not_interactive() -> None:
    """Drop ``sys.ps1``/``sys.ps2``: a rank runs cells, nobody types at its prompt.

    Libraries take ``sys.ps1`` as "an interactive session" and then refuse
    multi-process strategies (Lightning's ``strategy="ddp"``).
    """
    for name in ("ps1", "ps2"):
        if hasattr(sys, name):
            delattr(sys, name)


def apply(env: dict[str, str]) -> None:
    """Set ``env``, a command line argparse accepts, and a non-interactive interpreter."""
    os.environ.update(env)
    sys.argv[:] = CELL_ARGV
    not_interactive()
