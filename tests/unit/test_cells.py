"""Which cells may be sent silent: IPython (default settings) would show no value for them."""

from __future__ import annotations

import pytest

from nbdist.driver.cells import displays_nothing


@pytest.mark.parametrize(
    "code",
    [
        "",
        "pass",
        "x = 1",
        "for i in range(3):\n    print(i)",
        "def f():\n    return 1",
        "if rank == 0:\n    x\n",  # not a top-level expression: 'last_expr' shows nothing
        "import torch\nloss = model(x).sum()\nloss.backward()\nopt.step()\nopt.zero_grad(set_to_none=True)\ny = 0",
    ],
)
def test_cells_that_show_nothing(code):
    assert displays_nothing(code)


@pytest.mark.parametrize(
    "code",
    [
        "x",
        "print(rank)",  # None is not shown, but only running it tells
        "x = 1\nx",
        "x;",  # IPython hides it; left to the rank's shell
        "%time x = 1",
        "!ls",
        "x?",
        "%%time\nx = 1",
        "s = '%d' % 3",  # IPython syntax characters: the rank's transforms decide
        "x = (",  # does not parse: the rank reports the SyntaxError, as a cell
        "  x = 1",  # indented: IPython dedents it, Python does not
        "x = 1\0",
    ],
)
def test_cells_that_may_show_something(code):
    assert not displays_nothing(code)
