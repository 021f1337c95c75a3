"""What widget.js keeps of a dashboard, rebuilt from the model's messages, for unit tests.

A snapshot, then the deltas (new panels, respecs, resets, extends) in order, each sent
through strict JSON as the comm sends it (NaN goes as null); and the lines Plotly draws
of a trace with ``connectgaps`` off.
"""

from __future__ import annotations

import json


class WidgetStore:
    """widget.js's store: a snapshot, then deltas (panels, respec, reset, extend) in order."""

    def __init__(self, snapshot):
        """The store as the snapshot message leaves it."""
        self.panels = json.loads(json.dumps(snapshot["panels"], allow_nan=False))

    def receive(self, msg):
        """Apply one delta message (None: nothing was sent)."""
        if msg is None:
            return
        msg = json.loads(json.dumps(msg, allow_nan=False))
        self.panels += msg.get("panels", [])
        for spec in msg.get("respec", []):
            self.panels[spec["index"]] = spec
        for p, i, xs, ys in msg.get("reset", []):
            self.panels[p]["data"][i] = [xs, ys]
        for p, i, xs, ys in msg.get("extend", []):
            self.panels[p]["data"][i][0] += xs
            self.panels[p]["data"][i][1] += ys

    def traces(self, key=None):
        """{panel id: {trace name: (xs, ys)}}; with ``key``, that panel's {name: (xs, ys)}."""
        every = {p["id"]: dict(zip(p["names"], map(tuple, p["data"]))) for p in self.panels}
        return every if key is None else every[key]


def segments(xs, ys):
    """The lines Plotly draws of one trace: runs of (x, y) between nulls (connectgaps off)."""
    out, current = [], []
    for x, y in zip(xs, ys):
        if y is None:
            if current:
                out.append(current)
            current = []
        else:
            current.append((x, y))
    if current:
        out.append(current)
    return out
