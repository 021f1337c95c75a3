"""Kernel side: the parts of ipyparallel nbdist uses beyond its public API, in one place.

ipyparallel 9 has no public way to send an execute request with a user
expression, to read one rank's reply, accumulated output or engine from a
multi-engine result, to send a custom control message or to tell that a
client was closed,
its client assumes any IPython shell is a kernel, a reply whose value it
cannot unpickle is never answered, closing a client drops the requests it
has not yet handed to zmq, and what an engine publishes for a request the
client has finished with is kept where no one reads it and handed to no
callback. nbdist needs all nine, and
a terminal IPython too (see :mod:`nbdist.driver.cells`, :mod:`nbdist.driver.runner`,
:mod:`nbdist.driver.where`, :mod:`nbdist.driver.rank_relay`),
so they are reached here and nowhere else: an ipyparallel upgrade that renames
one breaks this module alone, and its tests say which.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import zmq

__all__ = [
    "awaiting_replies",
    "client_closed",
    "controller_interface",
    "fail_undecodable_replies",
    "flush_sends",
    "io_call_later",
    "per_engine_futures",
    "per_engine_ids",
    "per_engine_metadata",
    "queue_status",
    "reply_content",
    "result_client",
    "send_control",
    "send_execute",
    "tap_late_iopub",
    "tolerate_shells_without_kernel",
]


def awaiting_replies(client, engine_ids: Sequence[int]) -> set[int]:
    """Those of ``engine_ids`` this client has sent a request and has no reply from yet.

    The controller learns of a request a little after the client sent it, and of its
    end a little after the reply came; the client's own book has neither delay.
    """
    waiting = client._outstanding_dict  # noqa: SLF001 - engine uuid -> msg ids awaiting a reply
    uuids = client._engines  # noqa: SLF001 - engine id <-> uuid
    return {eid for eid in engine_ids if eid in uuids and waiting.get(uuids[eid])}


def queue_status(
    client, engine_ids: Sequence[int] | None, timeout: float, *, verbose: bool = False
) -> dict:
    """``client.queue_status(engine_ids, verbose)`` answered within ``timeout`` s, else TimeoutError.

    ipyparallel's own waits for the controller's reply without end: a controller that
    was killed, or ended with its named session elsewhere, would hang ``%dist_status``.
    ``engine_ids`` None: every engine.
    """
    from ipyparallel import util

    targets = None if engine_ids is None else list(engine_ids)
    content = {"targets": targets, "verbose": verbose}
    query = client._query_stream  # noqa: SLF001 - the controller's query channel
    future = client._send(query, "queue_request", content=content)  # noqa: SLF001
    if not future.wait(timeout):
        client._futures.pop(future.msg_id, None)  # noqa: SLF001 - no reply will come for it
        raise TimeoutError(f"the controller did not answer within {timeout:g} s")
    content = future.result()["content"]
    if content.pop("status") != "ok":
        raise client._unwrap_exception(content)  # noqa: SLF001 - as queue_status does
    return util.int_keys(content)


def per_engine_futures(async_result) -> list:
    """One future per engine of an ``AsyncResult``, in its targets' order (each rank's own reply)."""
    return list(async_result._children)  # noqa: SLF001


def per_engine_metadata(async_result) -> list:
    """Each engine's metadata dict (stdout, stderr, outputs accumulated so far), in order."""
    return list(async_result._metadata)  # noqa: SLF001


def per_engine_ids(async_result) -> list[int] | None:
    """The engine id of each child of an ``AsyncResult``, in order (None if it does not say)."""
    targets = async_result._targets  # noqa: SLF001
    return None if targets is None else list(targets)


def result_client(async_result):
    """The ipyparallel client that sent the requests of an ``AsyncResult``."""
    return async_result._client  # noqa: SLF001


def reply_content(result) -> dict:
    """The content of one engine's execute reply (an ``ExecuteReply``); {} if there is none."""
    return getattr(result, "_content", None) or {}


def send_execute(client, view, engine_ids: Sequence[int], content: dict, iopub_callbacks=None):
    """Send one execute request per engine, as ``DirectView.execute`` does; an ``AsyncResult``.

    ``content``: the execute request's content, which ``DirectView.execute``
    builds itself and cannot give ``user_expressions``. ``iopub_callbacks``: one
    callable per engine (same order), given each IOPub message of that engine's
    request from the first on: attached before the request is sent.
    """
    from ipyparallel.client.asyncresult import AsyncResult

    idents, targets = client._build_targets(list(engine_ids))  # noqa: SLF001
    callbacks = list(iopub_callbacks) if iopub_callbacks is not None else [None] * len(idents)
    futures = [
        client._send(  # noqa: SLF001
            view._socket,  # noqa: SLF001
            "execute_request",
            content=content,
            ident=ident,
            metadata=dict(label=None),
            track_outstanding=True,
            message_future_hook=_hook(callback),
        )
        for ident, callback in zip(idents, callbacks)
    ]
    return AsyncResult(client, futures, fname="execute", targets=targets, owner=True)


def _hook(callback):
    # ipyparallel calls it with the request's message future before handing the request
    # to its IO thread: a callback attached here cannot miss a message.
    if callback is None:
        return None
    return lambda future: future.iopub_callbacks.append(callback)


def tap_late_iopub(client, tap) -> None:
    """Hand ``tap(msg)`` each IOPub message of a request ``client`` has let go.

    ipyparallel lets a request go once its reply came and its engine went idle
    (its future and metadata are popped). An engine can publish for it later (a
    thread the request started prints): ipyparallel then stores the text in a
    fresh metadata entry that nothing reads or frees, appending to it for as long
    as the engine prints, and calls no callback. Here that entry is dropped and
    the message given to ``tap``, on the client's IO thread. Messages of requests
    still pending are ipyparallel's as before. Takes effect on the IO thread's
    next turn: a message arriving before is handled as before.
    """
    dispatch = type(client)._dispatch_iopub.__wrapped__  # noqa: SLF001 - under unpack_message
    session = client.session
    futures = client._futures  # noqa: SLF001 - msg id -> future, while the request is pending
    metadata = client.metadata

    def on_recv(parts) -> None:
        # What ipyparallel's unpack_message does, then its handler, then the tap.
        _idents, parts = session.feed_identities(parts, copy=False)
        try:
            msg = session.deserialize(parts, content=True, copy=False)
        except Exception:
            client.log.error("Invalid Message", exc_info=True)
            return
        dispatch(client, msg)
        parent = msg["parent_header"]
        if not parent or parent.get("session") != session.session:
            return  # another client's request: ipyparallel ignored it too
        msg_id = parent["msg_id"]
        if msg_id in futures:
            return
        metadata.pop(msg_id, None)
        try:
            tap(msg)
        except Exception:
            # The IO thread carries every reply: a failing tap must not stop it.
            client.log.error("nbdist: could not show late output", exc_info=True)

    stream = client._iopub_stream  # noqa: SLF001
    client._io_loop.add_callback(stream.on_recv, on_recv, copy=False)  # noqa: SLF001


def io_call_later(client, delay: float, callback, *args) -> None:
    """Call ``callback(*args)`` on ``client``'s IO thread in ``delay`` seconds."""
    client._io_loop.call_later(delay, callback, *args)  # noqa: SLF001


def send_control(client, engine_id: int, msg_type: str, content: dict):
    """Send a custom message on one engine's control channel; a future of its reply."""
    return client._send_control_request(  # noqa: SLF001
        targets=[engine_id], msg_type=msg_type, content=content, block=False
    )


def client_closed(client) -> bool:
    """Whether ``client`` was closed (its sockets gone: nothing it sent will be answered)."""
    return bool(getattr(client, "_closed", False))


# The client's streams that carry requests out (replies and iopub only come in).
_SENDING_STREAMS = (
    "_mux_stream",
    "_broadcast_stream",
    "_task_stream",
    "_control_stream",
    "_query_stream",
)


def flush_sends(client, timeout: float = 5.0) -> bool:
    """Hand every request ``client`` has queued to zmq; call it before closing the client.

    The client sends on its IO thread, and a stream passes a queued message to its
    socket only on the loop's next turn, while ``Client.close`` stops that loop after
    the current one: a cell sent with ``block=False`` just before the client closed
    (``--noblock``, then the kernel exiting or ``NamedSession.detach()``) never reached
    the ranks (19 times in 20, measured with a fresh client). Once handed to zmq, a
    message is delivered after the socket closes (zmq's linger). True when flushed
    within ``timeout`` s; False for a client whose IO thread has ended.
    """
    loop = getattr(client, "_io_loop", None)
    thread = getattr(client, "_io_thread", None)
    if client_closed(client) or loop is None or thread is None or not thread.is_alive():
        return False
    flushed = threading.Event()

    def flush() -> None:
        # Queued after the client's own send callbacks, so it runs once they have queued
        # their messages on the streams; on the IO thread, the only one touching them.
        try:
            for name in _SENDING_STREAMS:
                stream = getattr(client, name, None)
                if stream is not None and not stream.closed():
                    stream.flush(zmq.POLLOUT)
        finally:
            flushed.set()

    loop.add_callback(flush)
    return flushed.wait(timeout)


def controller_interface(client) -> str:
    """The controller's address as the client's connection info gives it (``tcp://host``), or ''."""
    return (client._config or {}).get("interface", "") or ""  # noqa: SLF001


def _kernel_shell_or_none():
    from IPython import get_ipython

    shell = get_ipython()
    # A terminal IPython (or a plain InteractiveShell) has no `kernel` attribute at all.
    return shell if shell is not None and hasattr(shell, "kernel") else None


def tolerate_shells_without_kernel() -> None:
    """Let ipyparallel's client run under a terminal IPython (idempotent).

    Its iopub handler reads ``get_ipython().kernel`` for every widget (comm)
    message from an engine, and a terminal shell has no such attribute: the
    AttributeError lost the rest of that cell's output (a rank's ``tqdm.auto``
    bar was enough). The client's module sees no shell there instead, which
    only costs it what it does for a kernel: forwarding widgets, colours, %px.
    """
    import ipyparallel.client.client as client_module

    if client_module.get_ipython is not _kernel_shell_or_none:
        client_module.get_ipython = _kernel_shell_or_none


def fail_undecodable_replies(client) -> None:
    """Make an apply or pull reply the kernel cannot unpickle fail its request (idempotent).

    ipyparallel unpickles a reply's value on its IO thread, in the handler that
    then completes the request's future. A value whose class exists only on the
    ranks (defined in a cell there, or from a module only they can import) raises
    there: the exception is printed as an "Uncaught exception in ZMQStream
    callback" and the future is never completed, so ``pull`` or ``apply`` waited
    forever. The failure is caught where it happens, in the kernel, rather than
    by pickling the value a second time on the rank first: only the kernel knows
    what it can import, and a value that arrives whole (a large tensor, without a
    copy) pays nothing more than a ``try``. That rank's result becomes an
    :class:`~nbdist.errors.UnpicklableValue`, which the waiting code reports like
    any rank's error; the client and its other requests go on as before.
    """
    handlers = client._queue_handlers  # noqa: SLF001
    handle_reply = handlers.get("apply_reply")
    if handle_reply is None or getattr(handle_reply, "nbdist_fails_undecodable", False):
        return

    def handle(msg):
        try:
            handle_reply(msg)
        except Exception as exc:  # noqa: BLE001 - any failure here would leave the request hanging
            _fail_reply(client, msg, exc)

    handle.nbdist_fails_undecodable = True
    handlers["apply_reply"] = handle


def _fail_reply(client, msg: dict, exc: Exception) -> None:
    from nbdist.errors import UnpicklableValue

    if client._should_use_metadata_msg_id(msg):  # noqa: SLF001
        msg_id = msg["metadata"]["original_msg_id"]
    else:
        msg_id = msg["parent_header"]["msg_id"]
    # The handler may have failed before it marked the request answered.
    client.outstanding.discard(msg_id)
    engine = msg.get("metadata", {}).get("engine")
    if engine is not None:
        client._outstanding_dict[engine].discard(msg_id)  # noqa: SLF001
    error = UnpicklableValue(f"{type(exc).__name__}: {exc}")
    client.results[msg_id] = error
    future = client._futures.get(msg_id)  # noqa: SLF001
    if future is not None and not future.done():
        future.set_result(error)
