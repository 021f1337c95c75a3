"""Kernel side: telling the controller that engines left, on their behalf.

An ipyparallel engine that leaves sends the controller an ``unregistration_request``;
one that dies cannot. Without that message the controller keeps a dead engine until its
heart has been silent for as long as it allows (:mod:`nbdist.launch.heartbeat`: never,
for the ranks the zygote forked, whose deaths nbdist sees through their pidfds). So
nbdist sends it for them: for a rank the moment its death is seen
(:mod:`nbdist.driver.session_watch`), and for the old ranks of a fast restart
(:mod:`nbdist.launch.restart`). The controller then drops the engine as if it had left
(and fails the requests it had queued for it after its registration timeout, 30 s).
"""

from __future__ import annotations

import json

__all__ = ["unregister"]


def unregister(handle, engine_ids) -> bool:
    """Ask ``handle``'s controller to drop ``engine_ids`` now, as a leaving engine does.

    Returns False where it cannot be sent (no client connection file): the controller then
    keeps the engines until their hearts' silence drops them. Under CurveZMQ (no HMAC key:
    messages go unsigned) the socket encrypts with the client's own keys, as the client does.
    """
    client = handle.client
    path = handle.client_file()
    engine_ids = sorted(engine_ids)
    if not engine_ids or client is None or path is None:
        return False
    import zmq
    from jupyter_client.session import Session

    try:
        with open(path) as f:
            info = json.load(f)
        url = f"{info['interface']}:{info['registration']}"
    except (OSError, ValueError, KeyError):
        return False
    session = client.session
    signer = Session(
        key=session.key,
        signature_scheme=session.signature_scheme,
        packer=session.packer,
        unpacker=session.unpacker,
    )
    # A socket of its own: this may run on a watcher thread while the client's sockets are
    # the kernel's (zmq sockets are not shared between threads; the context is).
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        if client.curve_serverkey:
            sock.curve_serverkey = client.curve_serverkey
            sock.curve_secretkey = client.curve_secretkey
            sock.curve_publickey = client.curve_publickey
        sock.linger = 1000
        sock.connect(url)
        for eid in engine_ids:
            signer.send(sock, "unregistration_request", content={"id": eid})
    finally:
        sock.close()
    return True
