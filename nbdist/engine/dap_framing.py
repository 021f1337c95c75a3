"""Both sides: the Debug Adapter Protocol's framing (``Content-Length`` headers, JSON bodies).

The kernel's client of a rank's debugpy (:mod:`nbdist.driver.rank_debugpy`) and
the rank's relay to its debugpy (:mod:`nbdist.engine.dap_relay`) write and read
the same frames: :func:`frame` makes one, :class:`Frames` takes bytes as they
arrive and gives back the whole messages among them.
"""

from __future__ import annotations

import json

__all__ = ["Frames", "frame"]


def frame(message: dict) -> bytes:
    """``message`` as one DAP frame: a ``Content-Length`` header, then its JSON."""
    body = json.dumps(message).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


class Frames:
    """Bytes in, in any pieces; whole messages out (a partial one waits for the rest)."""

    def __init__(self) -> None:
        """Nothing received yet."""
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[dict]:
        """The messages ``data`` completes, in order (``json`` raises on a body that is not)."""
        self.buffer += data
        found = []
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return found
            length = None
            for line in bytes(self.buffer[:head_end]).split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            start = head_end + 4
            if length is None:  # a header without a length: skipped
                del self.buffer[:start]
                continue
            if len(self.buffer) < start + length:
                return found
            found.append(json.loads(bytes(self.buffer[start : start + length])))
            del self.buffer[: start + length]
