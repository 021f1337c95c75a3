"""Kernel side: JupyterLab's debugger on a rank on another machine, relayed through its control channel.

A rank's debugpy listens on its own machine's loopback, which a kernel on
another machine cannot reach (and nbdist opens no debugger port beyond
loopback). :class:`RelayedRankConnection` is the same Debug Adapter Protocol
client as :class:`nbdist.driver.rank_debugpy.RankConnection`, but its messages
travel in nbdist's requests on the engine's control channel, which the session
already has (ipyparallel's, HMAC-signed; served by the rank's control thread
also while its main thread is stopped at a breakpoint): the rank's side
(:mod:`nbdist.engine.dap_relay`) connects to its debugpy on loopback, writes
what the kernel sends (``dap_send``) and answers polls (``dap_poll``) with what
debugpy sent. One thread per connection polls; a poll waits on the rank until
debugpy says something (a ``stopped`` event then arrives in one control round
trip) or :data:`POLL_WAIT_S` passes, and gives way at once to any other
control request (a request to debugpy, ``%dist_where``).

The connection ends, its thread with it, on :meth:`~RelayedRankConnection.close`,
when the rank's debugpy goes, when the engine leaves the cluster or when the
session's client is closed (``%dist_stop``, ``%dist_restart``).
"""

from __future__ import annotations

import concurrent.futures
import threading

from nbdist.driver import rank_debugpy as dap
from nbdist.driver.ipp_internals import client_closed, send_control
from nbdist.engine.control import REQUEST

__all__ = ["POLL_WAIT_S", "RelayedRankConnection"]

# How long one poll waits on the rank for debugpy to say something. Idle, a relayed
# rank costs the kernel one control round trip per POLL_WAIT_S. Nothing waits for
# it to pass: debugpy's messages end the poll, and so does any other control
# request (ipykernel reads the next one only after the poll's handler started).
POLL_WAIT_S = 5.0
# How often a thread waiting for a reply checks that the connection is still wanted.
_CHECK_S = 0.25


class RelayedRankConnection(dap.DapClient):
    """A Debug Adapter Protocol client of one rank's debugpy, through the engine's control channel."""

    def __init__(self, rank: int, client, engine_id: int, endpoint: tuple[str, int], on_event):
        """Relay to rank ``rank``'s debugpy at ``endpoint`` (host, port on the rank's own
        loopback), through ``client`` (the session's ipyparallel client) to engine
        ``engine_id``; ``on_event`` as :class:`~nbdist.driver.rank_debugpy.DapClient`'s."""
        super().__init__(rank, on_event)
        self.endpoint = endpoint
        self._client = client
        self._engine_id = engine_id
        self._closing = threading.Event()
        opened = self._answer(self._control("dap_open", port=endpoint[1]), dap.CONNECT_TIMEOUT_S)
        if opened is None:
            raise ConnectionError(f"rank {rank} did not answer on its control channel")
        self._token = opened["token"]
        self.pid = opened.get("pid")
        self._poller = dap.debugger_thread(self._poll, f"nbdist-lab-debugger-relay-rank{rank}")
        self._poller.start()

    def through(self, client) -> bool:
        """Whether this relay goes through ``client`` (an ipyparallel client)."""
        return self._client is client

    def _control(self, action: str, **content):
        return send_control(self._client, self._engine_id, REQUEST, {"action": action, **content})

    def _answer(self, future, timeout: float | None = None) -> dict | None:
        """The rank's ``dap`` reply to ``future``'s request; None once the connection is no longer
        wanted or possible (closed, engine gone, client closed) or ``timeout`` passed."""
        waited = 0.0
        # Waited on in slices, raising nothing while it waits (with "pause on raised
        # exceptions", the kernel's debugpy would see every timeout).
        while not concurrent.futures.wait([future], timeout=_CHECK_S).done:
            waited += _CHECK_S
            if (
                self._closing.is_set()
                or client_closed(self._client)
                or self._engine_id not in self._client.ids
                or (timeout is not None and waited >= timeout)
            ):
                return None
        msgs = future.result()
        content = (msgs[0] if isinstance(msgs, list) else msgs)["content"]
        if content.get("status") != "ok":
            raise ConnectionError(
                f"rank {self.rank}: {content.get('ename')}: {content.get('evalue')}"
            )
        return content["dap"]

    def _send(self, message: dict) -> None:
        if self.closed or self._closing.is_set():
            raise ConnectionError("the relay is closed")
        seq = message["seq"]
        future = self._control("dap_send", token=self._token, messages=[message])

        def sent(done) -> None:
            # The response itself comes with a poll; here only a send that failed.
            try:
                msgs = done.result()
                content = (msgs[0] if isinstance(msgs, list) else msgs)["content"]
                failed = content.get("status") != "ok" or content["dap"].get("closed")
            except Exception:  # noqa: BLE001 - the engine went away: the request fails
                failed = True
            if failed:
                # Not under self._lock: a reply already in makes this run inside request().
                self._fail(seq, ConnectionError("the relay is closed"))

        future.add_done_callback(sent)

    def _poll(self) -> None:
        try:
            while not self._closing.is_set():
                found = self._answer(self._control("dap_poll", token=self._token, wait=POLL_WAIT_S))
                if found is None:
                    return
                for message in found.get("messages", ()):
                    self._received(message)
                if found.get("closed"):
                    return
        except Exception:  # noqa: BLE001 - a client closed under a send ends the relay too
            return
        finally:
            self._gone()

    def close(self) -> None:
        """Close the relay: the rank closes its connection to debugpy (which then lets the rank
        run on, breakpoints cleared) and the polling thread ends."""
        if self._closing.is_set():
            return
        self._closing.set()
        if not client_closed(self._client):
            try:
                self._control("dap_close", token=self._token)
            except Exception:  # noqa: BLE001 - the engine or client is gone: nothing to close
                pass

    def wait_closed(self, timeout: float) -> None:
        """After :meth:`close`: wait up to ``timeout`` seconds for the polling thread to end (the
        poll in flight gives way to the close at once on the rank)."""
        if threading.current_thread() is not self._poller:
            self._poller.join(timeout)
