"""Both sides: the metrics wire format, JSON payloads signed with the cluster's key.

Ranks and the kernel share the ipyparallel cluster key (every engine's kernel
session already holds it). Each message is two frames, ``[signature,
payload]`` with ``signature = HMAC-SHA256(key, payload)`` in hex; the kernel
drops any message whose signature does not match before decoding it, and the
payload is JSON, never pickle, so nothing that arrives is executed.

Payload kinds::

    {"k": "points", "rank": 0, "points": [[step, time, {"loss": 0.5, ...}], ...], "total": 3000}
    {"k": "cell", "rank": 0, "cell": 1, "total": 3000}   # end of a standalone script's run

``total`` is the rank's running count of points sent, this message's included.
"""

from __future__ import annotations

import hashlib
import hmac
import json

__all__ = ["decode", "encode"]


def encode(key: bytes, message: dict) -> list[bytes]:
    """The two frames ``[signature, payload]`` of ``message``: JSON, signed with ``key``."""
    payload = json.dumps(message, separators=(",", ":")).encode()
    return [_sign(key, payload), payload]


def decode(key: bytes, frames: list[bytes]) -> dict | None:
    """The message, or None if it is malformed or not signed with ``key``."""
    if len(frames) != 2:
        return None
    signature, payload = frames
    if not hmac.compare_digest(signature, _sign(key, payload)):
        return None
    try:
        message = json.loads(payload)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


def _sign(key: bytes, payload: bytes) -> bytes:
    return hmac.new(key, payload, hashlib.sha256).hexdigest().encode()
