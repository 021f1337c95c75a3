"""A rank's tqdm.auto bar: live as a widget, and its text form (saved notebook, console, ListSink) final.

The widget messages below are those a real rank sent for
``for i in tqdm(range(5), desc='ep')`` (tqdm.notebook, ipywidgets 8), trimmed
to the fields that matter. Real tqdm loops on real ranks: ``tests/notebooks/test_tqdm.py``.
"""

from __future__ import annotations

from nbdist.driver.output import OutputMerger
from nbdist.driver.sinks import ListSink, StreamSink
from nbdist.driver.widget_text import WidgetTexts

_VIEW = "application/vnd.jupyter.widget-view+json"


def _open(comm_id, **state):
    return "comm_open", {
        "comm_id": comm_id,
        "target_name": "jupyter.widget",
        "data": {"state": state, "buffer_paths": []},
    }


def _update(comm_id, **state):
    return "comm_msg", {
        "comm_id": comm_id,
        "data": {"method": "update", "state": state, "buffer_paths": []},
    }


def _bar_messages(total=5, n=5, style="success"):
    return [
        _open("layout", _model_name="LayoutModel", width=None),
        _open("bar", _model_name="FloatProgressModel", value=0.0, min=0.0, max=float(total)),
        _open("left", _model_name="HTMLModel", value=""),
        _open("right", _model_name="HTMLModel", value=""),
        _update("left", value="ep"),
        _open(
            "box",
            _model_name="HBoxModel",
            children=["IPY_MODEL_left", "IPY_MODEL_bar", "IPY_MODEL_right"],
        ),
        _update("left", value="ep:\u2007\u2007\u20070%"),
        _update("right", value=f"\u20070/{total}\u2007[00:00&lt;?,\u2007?it/s]"),
        _update("bar", value=float(n)),
        _update("left", value=f"ep:\u2007{100 * n // total:3d}%".replace(" ", "\u2007")),
        _update("right", value=f"\u2007{n}/{total}\u2007[00:00&lt;00:00,\u200739.89it/s]"),
        *([_update("bar", bar_style=style)] if style else []),
    ]


def _display(model_id="box", text="ep:   0%|          | 0/5 [00:00<?, ?it/s]"):
    return {
        "text/plain": text,
        _VIEW: {"version_major": 2, "version_minor": 0, "model_id": model_id},
    }


def test_the_text_form_is_tqdms_own_line_at_the_bars_latest_state():
    texts = WidgetTexts()
    for kind, content in _bar_messages():
        texts.feed(kind, content)
    assert texts.text("box") == "ep: 100%|██████████| 5/5 [00:00<00:00, 39.89it/s]"
    assert texts.finished("box")
    assert texts.text("bar") is None  # not a bar's container
    half = WidgetTexts()
    for kind, content in _bar_messages(total=4, n=2, style=None):
        half.feed(kind, content)
    assert half.text("box") == "ep:  50%|█████     | 2/4 [00:00<00:00, 39.89it/s]"
    assert not half.finished("box")


def test_merger_gives_each_widget_display_one_update_when_its_bar_closes():
    sink = ListSink()
    merger = OutputMerger([0, 1], sink, window=0)
    for kind, content in _bar_messages(style=None):
        merger.feed_comm(0, kind, content)
    merger.feed_display(0, _display())
    merger.feed_display(1, {"text/plain": "42"})  # an ordinary display: no update
    merger.poll()
    assert [e[0] for e in sink.events] == ["display", "display"]  # still running: no update
    merger.feed_comm(0, *_update("bar", bar_style="success"))
    merger.poll()
    merger.close()
    updates = [e for e in sink.events if e[0] == "display_update"]
    assert len(updates) == 1
    _, label, data, _ = updates[0]
    assert label == "rank 0"
    assert data["text/plain"] == "ep: 100%|██████████| 5/5 [00:00<00:00, 39.89it/s]"
    assert data[_VIEW]["model_id"] == "box"  # still the live widget in a notebook


def test_console_prints_a_bar_once_in_its_final_state(capsys):
    merger = OutputMerger([0], StreamSink(), window=0)
    for kind, content in _bar_messages(style=None):
        merger.feed_comm(0, kind, content)
    merger.feed_display(0, _display())
    merger.poll()
    assert capsys.readouterr().out == ""  # 0 % is never printed
    merger.close()  # the cell ended before the bar closed: its latest state
    assert capsys.readouterr().out == (
        "[rank 0] ep: 100%|██████████| 5/5 [00:00<00:00, 39.89it/s]\n"
    )


def test_a_bar_that_erases_itself_leaves_no_text(capsys):
    """tqdm(leave=False) closes its widget: nothing stays, as its text bar erases itself."""
    sink = ListSink()
    merger = OutputMerger([0], sink, window=0)
    for kind, content in _bar_messages(style=None):
        merger.feed_comm(0, kind, content)
    merger.feed_display(0, _display())
    merger.poll()
    merger.feed_comm(0, "comm_close", {"comm_id": "box", "data": {}})
    merger.poll()
    assert sink.events[-1][0] == "display_update"
    assert sink.events[-1][2]["text/plain"] == ""
    console = OutputMerger([0], StreamSink(), window=0)
    for kind, content in _bar_messages(style=None):
        console.feed_comm(0, kind, content)
    console.feed_display(0, _display())
    console.feed_comm(0, "comm_close", {"comm_id": "box", "data": {}})
    console.close()
    assert capsys.readouterr().out == ""
