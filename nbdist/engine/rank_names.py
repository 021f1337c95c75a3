"""Rank side: the names every rank's namespace starts with, and ``%reset`` keeping them.

When a rank joins the group its namespace gets ``torch``, ``dist``, ``rank``,
``local_rank``, ``world_size``, ``device`` and ``nbdist`` (:func:`fill`), which cells
and the examples rely on. ``%reset -f`` in a cell (often run to free memory between
experiments) cleared them too, and the next cell failed with "NameError: name 'rank'
is not defined" on every rank. :func:`install` wraps the engine shell's ``reset``
(what ``%reset`` calls) so that the user's own names go and these come back; a name
deleted on purpose (``del rank``, ``%reset_selective``) stays deleted until then.

They are also the shell's hidden names, as IPython's own ``In`` and ``Out`` are: ``%who``
lists the user's names only, and a soft ``%reset -s`` (which deletes what ``%who``
lists) keeps them. A hidden name the user binds to something else is theirs again.

Example (on a rank)::

    >>> %reset -f
    >>> rank, world_size
    (1, 4)
"""

from __future__ import annotations

__all__ = ["fill", "install"]

# What fill() put in, for reset to put back (one engine shell per rank process).
_names: dict[str, object] = {}


def fill(shell, spec: dict, device: str) -> None:
    """Give ``shell``'s namespace the rank's names (``spec``: rank, local_rank, world_size)."""
    import torch
    import torch.distributed as dist

    _names.clear()
    _names.update(
        {
            "torch": torch,
            "dist": dist,
            "rank": spec["rank"],
            "local_rank": spec["local_rank"],
            "world_size": spec["world_size"],
            "device": torch.device(device),
        }
    )
    _put_back(shell)


def _put_back(shell) -> None:
    shell.user_ns.update(_names)
    # The package itself, as a user's own import line would bring it (this module
    # belongs to the rank side and does not import the kernel-side API).
    shell.ex("import nbdist")
    shell.user_ns_hidden.update(_names, nbdist=shell.user_ns["nbdist"])


def install(shell) -> None:
    """Make ``shell.reset`` (``%reset``) put the rank's names back (idempotent)."""
    reset = shell.reset
    if getattr(reset, "nbdist_original", None) is not None:
        return

    def reset_keeping_rank_names(*args, **kwargs):
        reset(*args, **kwargs)
        _put_back(shell)

    reset_keeping_rank_names.nbdist_original = reset
    shell.reset = reset_keeping_rank_names
