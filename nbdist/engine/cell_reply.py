"""Rank side: what a rank says about itself at the end of each cell, in its execute reply.

:func:`install` wraps the engine kernel's ``do_execute`` so that every execute
reply carries :func:`after_cell`'s answer under the content key ``nbdist``. The
answer rides on the execute reply the kernel waits for anyway:

- the rank's running count of ``nbdist.log`` points sent (it sends what the
  cell logged first), so the kernel knows how many points to wait for;
- the shell's ``ast_node_interactivity``, which says whether a cell with no
  expression to show may be sent *silent*.

A cell whose code caught an interrupt's KeyboardInterrupt and ended without an
error also says so, under :data:`CAUGHT_KEY`: a handler quicker than the kernel's
question to the ranks still running (:mod:`nbdist.driver.caught_interrupts`) is
then named as one, not taken for a cell the interrupt came too late for.

Where the wrapper is not in place (an engine nbdist did not set up), the kernel
asks the same through a Jupyter *user expression* (:data:`nbdist.driver.cells.AFTER_CELL`),
which IPython compiles, evaluates and formats into a display bundle on every
cell: about 0.3 ms more per no-op cell on 2 cores (bench/roundtrip.py).
"""

from __future__ import annotations

import inspect

__all__ = ["CAUGHT_KEY", "REPLY_KEY", "after_cell", "install"]

# The execute reply's content key for the answer (the kernel reads it: nbdist.driver.cells).
REPLY_KEY = "nbdist"
# Present (True) in the reply of a cell whose code caught the interrupt and ended well.
CAUGHT_KEY = "nbdist_caught"


def after_cell(shell=None) -> str:
    """``"<points sent> <ast_node_interactivity>"`` (-1: no metrics channel; 'unknown': no shell)."""
    from nbdist.metrics.log import end_of_cell  # rank-side; the kernel imports only REPLY_KEY

    total = end_of_cell()
    interactivity = getattr(shell, "ast_node_interactivity", None) or "unknown"
    return f"{-1 if total is None else total} {interactivity}"


def install(kernel, shell) -> None:
    """Add :func:`after_cell`'s answer to every execute reply of ``kernel`` (idempotent).

    Failed cells answer too: the points logged before the error are sent and counted.
    """
    plain = kernel.do_execute
    if getattr(plain, "nbdist_plain", None) is not None:
        return
    from nbdist.engine.late_interrupt import handling_interrupt  # rank-side, like after_cell's

    async def do_execute(*args, **kwargs):
        reply = plain(*args, **kwargs)
        if inspect.isawaitable(reply):
            reply = await reply
        try:
            answer = reply[REPLY_KEY] = after_cell(shell)
            # ipyparallel's client keeps only the error fields and engine_info of a
            # failed cell's reply: the answer goes there too.
            info = reply.get("engine_info")
            if reply.get("status") == "error" and isinstance(info, dict):
                info[REPLY_KEY] = answer
            # Still this request's: the handler hooks end it after do_execute returns.
            if reply.get("status") == "ok" and handling_interrupt():
                reply[CAUGHT_KEY] = True
        except Exception:  # the reply itself must go out whatever happens here
            pass
        return reply

    do_execute.nbdist_plain = plain
    kernel.do_execute = do_execute
