"""Kernel side: how a cell travels to the ranks, and what each rank's execute reply says back.

One execute request per rank, as ipyparallel's ``DirectView.execute`` sends it.
Each rank's execute reply carries, under the content key ``nbdist`` (put there
by :func:`nbdist.engine.cell_reply.install`, failed cells included):

- the rank's running count of metrics points sent (it sends what the cell
  logged first), so the kernel knows how many points to wait for without an
  extra message per cell (``nbdist.metrics.hub.MetricsHub.settle``);
- the rank's ``ast_node_interactivity``, which says whether a cell with no
  expression to show may be sent *silent* (see :meth:`CellChannel.execute`).

A cell whose code caught an interrupt's KeyboardInterrupt and ended well says that
too (:func:`caught_in_reply`).

Both answers ride on the reply the kernel waits for anyway; a no-op cell's round
trip is a few ms, so one more message per rank and cell would be measurable. An
engine whose replies do not carry them yet (its first cell, or an engine nbdist
did not set up) is asked through a Jupyter *user expression*, :data:`AFTER_CELL`,
instead, which IPython compiles, evaluates and formats on every cell: dropping
it once the replies answer made a no-op ``%%on_all_ranks`` 1.07x raw
``DirectView.execute`` at 2 ranks instead of 1.10-1.15x (bench/RESULTS.md).
"""

from __future__ import annotations

import ast
import weakref
from collections.abc import Iterable, Sequence

from nbdist.driver.ipp_internals import reply_content, send_execute
from nbdist.engine.cell_reply import CAUGHT_KEY, REPLY_KEY

__all__ = ["AFTER_CELL", "CellChannel", "caught_in_reply", "cell_channel", "displays_nothing"]

# Evaluated on each rank, in its namespace (where get_ipython is defined).
AFTER_CELL = "__import__('nbdist.engine.cell_reply', fromlist=['_']).after_cell(get_ipython())"
_KEY = "nbdist"


def _answer(result) -> tuple[int | None, str | None, bool]:
    """(points sent or None, interactivity or None, whether the answer came in the reply's
    content) from one rank's execute reply."""
    content = reply_content(result)
    answer = content.get(REPLY_KEY) if isinstance(content, dict) else None
    if answer is None:  # a failed cell: ipyparallel's error keeps the reply's engine_info
        answer = (getattr(result, "engine_info", None) or {}).get(REPLY_KEY)
    in_content = isinstance(answer, str)
    try:
        if not in_content:
            reply = content["user_expressions"][_KEY]
            if reply["status"] != "ok":
                return None, None, False
            answer = ast.literal_eval(reply["data"]["text/plain"])
        total, interactivity = answer.split(" ", 1)
        total = int(total)
        return (total if total >= 0 else None), interactivity, in_content
    except (AttributeError, KeyError, TypeError, ValueError, SyntaxError):
        return None, None, in_content  # an error reply: user expressions are not evaluated then


def caught_in_reply(result) -> bool:
    """Whether one rank's execute reply says its code caught an interrupt's
    KeyboardInterrupt and ended without an error (False for anything else)."""
    return bool(reply_content(result).get(CAUGHT_KEY))


def displays_nothing(code: str) -> bool:
    """True when IPython, with its default ``ast_node_interactivity`` ('last_expr'),
    shows no value for ``code``: the cell does not end with an expression statement.

    Cells with IPython syntax (``%``, ``!``, ``?``) or that do not parse as Python
    count as showing something: IPython's transforms decide those on the rank.
    """
    if any(ch in code for ch in "%!?"):
        return False
    try:
        body = ast.parse(code).body
    except (SyntaxError, ValueError):  # ValueError: a null byte
        return False
    return not body or not isinstance(body[-1], ast.Expr)


class CellChannel:
    """Sends cells to one client's engines; remembers what their replies said."""

    def __init__(self, client):
        """The channel of ``client`` (held weakly: the channel lives on the client)."""
        self._client = weakref.ref(client)
        self._views: dict[tuple[int, ...], object] = {}
        # Engines whose last reply said 'last_expr' (IPython's default): for them
        # displays_nothing() matches what their shell would show.
        self._last_expr: set[int] = set()
        # Engines whose execute replies carry nbdist's answer (nbdist.engine.cell_reply.install):
        # they are sent no user expression.
        self._answers_in_reply: set[int] = set()

    def view(self, engine_ids: Sequence[int]):
        """The ``DirectView`` of these engines, made once and reused by every cell."""
        # Building a DirectView costs ~0.3 ms (traitlets): each cell reuses its ranks'.
        key = tuple(engine_ids)
        view = self._views.get(key)
        if view is None:
            # A list, even for one rank: per-rank results stay lists.
            view = self._views[key] = self._client()[list(engine_ids)]
        return view

    def execute(
        self,
        engine_ids: Sequence[int],
        code: str,
        *,
        silent_if_possible: bool = False,
        iopub_callbacks=None,
    ):
        """Send ``code`` to the engines (non-blocking); an ipyparallel AsyncResult.

        ``iopub_callbacks``: one per engine, given every IOPub message of its request
        (attached before the request is sent: see :mod:`nbdist.driver.early_iopub`).

        A cell is sent as a notebook sends it (``silent=False``: execution count,
        execute_input, the value of a last expression shown), except when nothing
        would be shown and nothing can be queued behind it: then ``silent=True``,
        which spares every rank the execute_input message and the cell hooks
        (~1 ms of a ~10 ms round trip on 2 cores). Silent cells do not advance the
        ranks' execution count, and ``pre_run_cell``/``post_run_cell`` hooks on the
        ranks do not fire for them (``pre_execute``/``post_execute`` do).
        ``silent_if_possible`` says the caller waits for the cell before sending
        another: a failing loud cell makes its rank drop requests queued behind
        it, a silent one does not, so queued cells (``--noblock``) stay loud.
        """
        client = self._client()
        view = self.view(engine_ids)
        silent = (
            silent_if_possible and self._last_expr.issuperset(engine_ids) and displays_nothing(code)
        )
        # What DirectView.execute sends, plus (for an engine whose replies have not yet
        # carried nbdist's answer) the user expression it has no argument for.
        asks = {} if self._answers_in_reply.issuperset(engine_ids) else {_KEY: AFTER_CELL}
        content = dict(code=code, silent=silent, user_expressions=asks)
        return send_execute(client, view, engine_ids, content, iopub_callbacks)

    def learn(self, engine_ids: Iterable[int], results: Iterable) -> list[int | None]:
        """Take what each engine's reply said about its shell; the points each had sent."""
        sent = []
        for engine_id, result in zip(engine_ids, results):
            points, interactivity, in_reply = _answer(result)
            sent.append(points)
            if in_reply:
                self._answers_in_reply.add(engine_id)
            if interactivity == "last_expr":
                self._last_expr.add(engine_id)
            else:  # another setting, or not answered (an error): loud until it says again
                self._last_expr.discard(engine_id)
        return sent


def cell_channel(client) -> CellChannel:
    """The client's channel, kept on the client itself: it goes with the client (a
    restart makes a new client, and starts afresh). A dictionary keyed by weak
    references would not let the client go: its views hold it strongly."""
    channel = getattr(client, "nbdist_cells", None)
    if channel is None:
        channel = client.nbdist_cells = CellChannel(client)
    return channel
