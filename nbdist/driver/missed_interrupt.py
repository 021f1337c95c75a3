"""Kernel side: after an interrupt, each rank is asked whether the SIGINT missed its request.

SIGINT reaches a rank at once, the request it was meant for takes a while: a rank
that had not begun it ignored the SIGINT (an idle engine does), or the SIGINT ended
an earlier request the rank was finishing, and the rank would then run the whole
request. Whether a rank has begun cannot be seen from here (its "busy" message comes
before it handles SIGINT), so every rank still running is asked on its control
channel about its request (:func:`nbdist.engine.late_interrupt.interrupt_request`):
it drops the request unrun, or interrupts it if it began after the SIGINT.
A rank that answers "dropped" (or "beginning") is asked again until its reply
comes: it may have begun the request in the moment it answered.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from nbdist.driver.ipp_internals import (
    per_engine_futures,
    per_engine_ids,
    result_client,
    send_control,
)
from nbdist.engine.control import REQUEST
from nbdist.engine.late_interrupt import boot_id

__all__ = ["MissedInterrupt"]

# When a rank is asked again, by its last answer, while its reply has not come: one
# about to run the request is interrupted a moment later; one that dropped it waits
# for an earlier request to end, which may take long.
_ASK_AGAIN_S = {"beginning": 0.1, "dropped": 0.5}


class MissedInterrupt:
    """Asks the engines of some of a request's ranks to stop it, until each has settled."""

    def __init__(self, async_result, indices: Sequence[int], since: float):
        """Follow the children of ``async_result`` at ``indices`` (ranks still running);
        ``since``: when the kernel began sending the SIGINTs (``time.monotonic``)."""
        self._sent = {"since": since, "boot": boot_id()}
        engines = per_engine_ids(async_result)
        self._client = result_client(async_result)
        self._children = per_engine_futures(async_result)
        # {child index: its engine}; a result that does not name its engines is not followed.
        self._engines = {} if engines is None else {i: engines[i] for i in indices}
        self._asked: dict[int, object] = {}  # child index -> the future of its reply
        self._next_ask = dict.fromkeys(self._engines, 0.0)  # child index -> when (monotonic)
        self.answers: dict[int, str] = {}  # child index -> the rank's last answer

    def poll(self) -> None:
        """Read the answers that came; ask again those that may still run it. Never blocks."""
        now = time.monotonic()
        for i in list(self._engines):
            if self._children[i].done():  # its reply came: dropped, stopped or finished
                self._forget(i)
                continue
            future = self._asked.get(i)
            if future is not None and future.done():
                del self._asked[i]
                answer = self.answers[i] = _answer(future)
                if answer not in _ASK_AGAIN_S:  # interrupted, running, ended, no nbdist engine
                    self._forget(i)
                    continue
                self._next_ask[i] = now + _ASK_AGAIN_S[answer]
            if i in self._asked or now < self._next_ask[i]:
                continue
            content = {"action": "interrupt", "msg_id": self._children[i].msg_id, **self._sent}
            try:
                self._asked[i] = send_control(self._client, self._engines[i], REQUEST, content)
            except IndexError:  # the engine left the cluster (it died): nothing to stop
                self._forget(i)

    def _forget(self, i: int) -> None:
        self._engines.pop(i, None)
        self._asked.pop(i, None)
        self._next_ask.pop(i, None)


def _answer(future) -> str:
    try:
        msgs = future.result()
    except Exception:  # the engine went away meanwhile
        return "gone"
    msg = msgs[0] if isinstance(msgs, list) else msgs
    content = msg.get("content", {})
    return str(content.get("interrupt", "")) if content.get("status") == "ok" else "refused"
