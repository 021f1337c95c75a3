"""Kernel side: the text form of a progress-bar widget a rank drew (``tqdm.auto`` in a notebook).

On a rank, ``tqdm.auto`` picks ``tqdm.notebook``: one display whose
``text/plain`` is the bar as it was when drawn (0 %), then widget state
updates as comm messages, which ipyparallel relays to the notebook so the
widget stays live. Viewers that show ``text/plain`` instead (a saved notebook
read without widget state, a console, :class:`~nbdist.driver.sinks.ListSink`)
would keep the 0 %. :class:`WidgetTexts` follows the comm messages of one rank
and rebuilds the bar's text as tqdm prints it::

    ep: 100%|██████████| 5/5 [00:00<00:00, 39.89it/s]

tqdm's widget is an ``HBox`` of three models: an ``HTML`` left text
("ep: 100%"), a progress bar (value/max) and an ``HTML`` right text
(" 5/5 [...]"), with spaces sent as U+2007 and HTML-escaped. Other widgets
have no text form here (:meth:`WidgetTexts.text` returns None).
"""

from __future__ import annotations

import html

__all__ = ["WidgetTexts", "widget_model_id"]

_WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# The model fields the text form needs; every other field (layout, style...) is dropped.
_KEPT = frozenset({"_model_name", "children", "value", "max", "min", "bar_style"})
_MODELS = frozenset({"HBoxModel", "HTMLModel", "FloatProgressModel", "IntProgressModel"})
_BLOCKS = " ▏▎▍▌▋▊▉█"  # tqdm's unicode bar: eighths of a cell
_BAR_WIDTH = 10  # tqdm's bar width when it cannot know the screen's


def widget_model_id(data: dict) -> str | None:
    """The widget model a display bundle shows, or None for an ordinary display."""
    view = data.get(_WIDGET_VIEW)
    if isinstance(view, dict) and isinstance(view.get("model_id"), str):
        return view["model_id"]
    return None


def _unhtml(value) -> str:
    return html.unescape(str(value or "")).replace("\u2007", " ")


def _bar(fraction: float) -> str:
    fraction = min(max(fraction, 0.0), 1.0)
    full, part = divmod(int(fraction * _BAR_WIDTH * 8), 8)
    text = _BLOCKS[-1] * full + (_BLOCKS[part] if full < _BAR_WIDTH and part else "")
    return text.ljust(_BAR_WIDTH)


class WidgetTexts:
    """The widgets of one rank, as far as a progress bar's text needs them."""

    def __init__(self) -> None:
        """No widgets known yet."""
        self._models: dict[str, dict] = {}
        self._closed: set[str] = set()

    def feed(self, msg_type: str, content: dict) -> None:
        """Take one comm message (``comm_open``, ``comm_msg``, ``comm_close``) of this rank."""
        comm_id = content.get("comm_id")
        if not isinstance(comm_id, str):
            return
        data = content.get("data") or {}
        if msg_type == "comm_open":
            state = data.get("state") or {}
            if state.get("_model_name") in _MODELS:
                self._models[comm_id] = {k: v for k, v in state.items() if k in _KEPT}
        elif msg_type == "comm_msg":
            model = self._models.get(comm_id)
            if model is not None and data.get("method") == "update":
                state = data.get("state") or {}
                model.update((k, v) for k, v in state.items() if k in _KEPT)
                if state.get("bar_style") == "info":
                    model["no_total"] = True  # tqdm's sign for a bar without a total
        elif msg_type == "comm_close":
            self._closed.add(comm_id)

    def _parts(self, model_id: str):
        box = self._models.get(model_id)
        if box is None or box.get("_model_name") != "HBoxModel":
            return None
        children = [str(c).removeprefix("IPY_MODEL_") for c in box.get("children") or []]
        if len(children) != 3:
            return None
        left, bar, right = (self._models.get(c) for c in children)
        if left is None or bar is None or right is None:
            return None
        if "value" not in bar or "max" not in bar:
            return None
        return left, bar, right

    def text(self, model_id: str) -> str | None:
        """The bar's current text as tqdm prints it, or None if ``model_id`` is no such bar.

        A bar whose widget was closed (``tqdm(leave=False)``) reads "": it was
        meant to vanish, as tqdm's text bar erases itself.
        """
        parts = self._parts(model_id)
        if parts is None:
            return None
        if model_id in self._closed:
            return ""
        left, bar, right = parts
        left_text, right_text = _unhtml(left.get("value")), _unhtml(right.get("value"))
        if bar.get("no_total") or not left_text:  # no total: no bar, "ep: 30/? [00:01, ...]"
            return " ".join(t for t in (left_text.strip(), right_text.strip()) if t)
        low = float(bar.get("min") or 0)
        span = float(bar["max"]) - low
        fraction = (float(bar["value"]) - low) / span if span > 0 else 1.0
        return f"{left_text}|{_bar(fraction)}|{right_text}"

    def finished(self, model_id: str) -> bool:
        """The bar was closed (tqdm marks it success or danger, or closes the widget)."""
        if model_id in self._closed:
            return True
        parts = self._parts(model_id)
        return parts is not None and parts[1].get("bar_style") in ("success", "danger")
