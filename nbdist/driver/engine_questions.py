"""Kernel side: asking a session's engines something before they are ranks, within --timeout.

Before the group forms, nbdist asks every engine to describe itself and rank 0's
engine to open the rendezvous. An engine that never answers (stopped, busy with
another client's work on a cluster nbdist attached to, hung in native code) used
to hold ``%dist_start`` forever, whatever its ``--timeout``. Here the wait ends at
that timeout: nbdist takes its request back (an engine that frees up later does
not run it, so no rendezvous socket opens where nobody will connect) and the
error names the engines, what the controller says they hold and, for engines
whose processes run on this machine, what each process is doing (stopped, asleep,
in disk wait: :mod:`nbdist.driver.process_state`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from nbdist.driver.ipp_internals import flush_sends, per_engine_futures, queue_status
from nbdist.driver.process_state import process_states, states_in_words
from nbdist.errors import NbdistError

__all__ = ["ask_engines", "silent_engines_message", "take_back"]


def ask_engines(
    client,
    engine_ids: Sequence[int],
    fn: Callable,
    *args,
    timeout: float,
    asking: str,
    suspects: Callable[[dict[int, Any]], Sequence] | None = None,
    engines_stay: bool = True,
) -> list:
    """``fn(*args)`` on each engine of ``engine_ids``; their results in that order.

    ``timeout``: the start's --timeout, in seconds; ``asking``: what nbdist asked,
    for the error ("for its host, address and devices"). ``suspects(answers)``: given
    the answers that came ({engine id: result}), the processes on this machine
    (``psutil.Process``) of the engines that did not answer, whose states the error
    then says (None: not known, as for engines on other hosts); ``engines_stay``: False
    where the failed start stops the engines (it then names no command to run on them).
    Raises :class:`NbdistError` naming the engines that did not answer in time; a
    Ctrl-C takes the request back too. An engine's own error comes as ipyparallel
    raises it.
    """
    import ipyparallel as ipp

    ids = list(engine_ids)
    ar = client[ids].apply_async(fn, *args)
    try:
        return ar.get(timeout)
    except ipp.error.TimeoutError:
        silent = _unanswered(ar, ids)
        if not silent:  # the last answer came as the wait ended
            return ar.get(0)
        ahead = _ahead(client, silent)  # counted before the abort changes the queues
        states = process_states(suspects(_answers(ar, ids))) if suspects is not None else ()
        take_back(client, ar, ids)
        raise NbdistError(
            silent_engines_message(sorted(silent), ahead, timeout, asking, states, engines_stay)
        ) from None
    except BaseException:
        take_back(client, ar, ids)
        raise


def take_back(client, ar, engine_ids: Sequence[int]) -> None:
    """Abort ``ar``'s requests to those of ``engine_ids`` that have not answered (in order).

    A request an engine has not begun stays in its queue: one that frees up later (a
    stopped engine continued, another client's work done) would run it, long after the
    start gave up. Aborted, it answers "aborted" instead; one already running is not
    stopped by this (an interrupt does that).
    """
    silent = _unanswered(ar, list(engine_ids))
    if silent:
        client.abort(list(silent.values()), targets=list(silent), block=False)
        # The failed start closes the client next, which drops what its IO thread has not
        # yet handed to zmq: the abort was lost so under load (the engine then ran the
        # request). Handed over, zmq delivers it after the close.
        flush_sends(client)


def _unanswered(ar, ids: list[int]) -> dict[int, str]:
    # {engine id: nbdist's request to it} for each engine that has not answered.
    return {
        eid: msg_id
        for eid, msg_id, child in zip(ids, ar.msg_ids, per_engine_futures(ar))
        if not child.done()
    }


def _answers(ar, ids: list[int]) -> dict[int, Any]:
    # {engine id: its result} for each engine that answered without an error.
    return {
        eid: child.result()
        for eid, child in zip(ids, per_engine_futures(ar))
        if child.done() and child.exception() is None
    }


def _ahead(client, silent: dict[int, str]) -> dict[int, int] | None:
    # {engine: requests queued before nbdist's}, as the controller counts them (its
    # count holds the request running and nbdist's own); None where it did not say.
    try:
        status = queue_status(client, list(silent), 5.0)
    except Exception:  # noqa: BLE001 - the error names the engines without it
        return None
    return {eid: max(0, int(status.get(eid, {}).get("queue", 1)) - 1) for eid in silent}


def silent_engines_message(
    silent: Sequence[int],
    ahead: dict[int, int] | None,
    timeout: float,
    asking: str,
    states: Sequence[tuple[int, str]] = (),
    engines_stay: bool = True,
) -> str:
    """What the start's error says of engines that did not answer in ``timeout`` s.

    ``ahead``: {engine: requests queued before nbdist's} (None: the controller did not
    say); ``states``: ``(pid, state)`` of the silent engines' processes on this machine
    (:func:`~nbdist.driver.process_state.process_states`; empty where not known);
    ``engines_stay``: whether they outlive the error (commands to run on them are named then).

    >>> print(silent_engines_message([1], {1: 1}, 8, "for its host, address and devices"))
    engine 1 did not answer within 8 s (%dist_start --timeout 8) when nbdist asked it for its host, address and devices: it is running other work (1 request before nbdist's): let that finish or interrupt it, then start again. nbdist took its request back.
    """
    few = len(silent) == 1
    head = (
        f"{_engines(silent)} did not answer within {timeout:g} s (%dist_start --timeout {timeout:g}) "
        f"when nbdist asked {'it' if few else 'each'} {asking}"
    )
    busy = {eid: n for eid, n in (ahead or {}).items() if n}
    idle = [eid for eid in silent if ahead is not None and not ahead.get(eid)]
    why = []
    if busy:
        counts = ", ".join(f"{n} request{'s' if n > 1 else ''}" for n in busy.values())
        who = "it is" if few else f"{_engines(busy)} {'is' if len(busy) == 1 else 'are'}"
        why.append(
            f"{who} running other work ({counts} before nbdist's): let that finish or "
            "interrupt it, then start again"
        )
    if idle:
        one = len(idle) == 1
        who = "it holds" if few else f"{_engines(idle)} {'holds' if one else 'hold'}"
        if states:  # what they are doing is known: no list of what it might be
            why.append(f"{who} nbdist's request alone")
        else:
            why.append(
                f"{who} nbdist's request alone, so {'it is' if one else 'they are'} stopped "
                "(SIGSTOP), swapping, or hung in native code: py-spy dump --pid shows where"
            )
    if ahead is None:
        why.append("the controller did not say what they hold")
    if states:
        why.append(states_in_words(states, of=len(silent), stay=engines_stay))
    return f"{head}: {'; '.join(why)}. nbdist took its request back."


def _engines(ids) -> str:
    ids = sorted(ids)
    return f"engine {ids[0]}" if len(ids) == 1 else "engines " + ",".join(map(str, ids))
