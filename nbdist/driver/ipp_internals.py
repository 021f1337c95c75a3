"""Kernel side: the parts of ipyparallel nbdist uses beyond its public API, in one place.

ipyparallel 9 has no public way to send an execute request with a user
expression, to read one rank's reply or accumulated output from a multi-engine
result, or to send a custom control message. nbdist needs all four (see
:mod:`nbdist.driver.cells`, :mod:`nbdist.driver.runner`, :mod:`nbdist.driver.where`),
so they are reached here and nowhere else: an ipyparallel upgrade that renames
one breaks this module alone, and its tests say which.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "controller_interface",
    "per_engine_futures",
    "per_engine_metadata",
    "reply_content",
    "send_control",
    "send_execute",
]


def per_engine_futures(async_result) -> list:
    """One future per engine of an ``AsyncResult``, in its targets' order (each rank's own reply)."""
    return list(async_result._children)  # noqa: SLF001


def per_engine_metadata(async_result) -> list:
    """Each engine's metadata dict (stdout, stderr, outputs accumulated so far), in order."""
    return list(async_result._metadata)  # noqa: SLF001


def reply_content(result) -> dict:
    """The content of one engine's execute reply (an ``ExecuteReply``); {} if there is none."""
    return getattr(result, "_content", None) or {}


def send_execute(client, view, engine_ids: Sequence[int], content: dict):
    """Send one execute request per engine, as ``DirectView.execute`` does; an ``AsyncResult``.

    ``content``: the execute request's content, which ``DirectView.execute``
    builds itself and cannot give ``user_expressions``.
    """
    from ipyparallel.client.asyncresult import AsyncResult

    idents, targets = client._build_targets(list(engine_ids))  # noqa: SLF001
    futures = [
        client._send(  # noqa: SLF001
            view._socket,  # noqa: SLF001
            "execute_request",
            content=content,
            ident=ident,
            metadata=dict(label=None),
            track_outstanding=True,
        )
        for ident in idents
    ]
    return AsyncResult(client, futures, fname="execute", targets=targets, owner=True)


def send_control(client, engine_id: int, msg_type: str, content: dict):
    """Send a custom message on one engine's control channel; a future of its reply."""
    return client._send_control_request(  # noqa: SLF001
        targets=[engine_id], msg_type=msg_type, content=content, block=False
    )


def controller_interface(client) -> str:
    """The controller's address as the client's connection info gives it (``tcp://host``), or ''."""
    return (client._config or {}).get("interface", "") or ""  # noqa: SLF001
