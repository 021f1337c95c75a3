"""A ``--noblock`` cell whose rank fails while the notebook's kernel is idle (a real Jupyter
kernel, 2 gloo CPU ranks, the group's default 30-minute timeout).

Nothing of the session waits while the user reads or types: the kernel's own event loop drives
the cell's guard, so the rank waiting for the failed one is released then, not when the user
next runs a cell of the session (or after the group's timeout).
"""

from __future__ import annotations

import json
import time

from tests.notebooks.conftest import strip_ansi

# Rank 1 fails 1 s in; rank 0 waits for it in an all-reduce it never enters.
_FAILING = (
    "%%on_all_ranks --noblock\n"
    "import time\n"
    "time.sleep(1)\n"
    "if rank == 1:\n"
    "    raise ValueError('bad batch on rank 1')\n"
    "dist.all_reduce(torch.ones(4))\n"
)
# Plain Python in the kernel: reads what the ranks replied (ipyparallel's record of them)
# without waiting for anything, so it drives no guard itself.
_STATES = "import json; print(json.dumps(background.child_states()))"
# Well inside the group's 30-minute timeout, which alone ended the wait before.
_LOOK_FOR_S = 60


def test_a_failed_noblock_cell_releases_its_ranks_while_the_kernel_is_idle(dist_kernel):
    dist_kernel.ok(_FAILING)
    dist_kernel.ok("background = _")  # the cell's value: its run
    deadline = time.monotonic() + _LOOK_FOR_S
    while True:
        time.sleep(1.0)  # the kernel idle, as while the user reads
        states = json.loads(dist_kernel.ok(_STATES).stdout)
        if states["0"] != "running" or time.monotonic() > deadline:
            break
    # Rank 0 left its all-reduce without any wait of the session.
    assert states == {"0": "error", "1": "error"}, states
    failed = dist_kernel.execute("background.wait()")
    assert failed.status == "error"
    text = strip_ansi(failed.error_text())
    assert "rank 1: ValueError: bad batch on rank 1" in text, text
    assert "rank 1 failed; the others were released: rank 0 from all_reduce #" in text, text
    # The group works again.
    dist_kernel.ok(
        "%%on_all_ranks\nt = torch.ones(1) * (rank + 1); dist.all_reduce(t); assert t.item() == 3"
    )


def test_a_noblock_cell_running_well_is_left_alone_while_idle(dist_kernel):
    # Rank 0 waits 3 s in the all-reduce for rank 1, which computes: no failure, no release.
    dist_kernel.ok(
        "%%on_all_ranks --noblock\nimport time\nif rank == 1:\n    time.sleep(3)\n"
        "t = torch.ones(1)\ndist.all_reduce(t)"
    )
    dist_kernel.ok("background = _")
    time.sleep(5)  # idle past rank 1's sleep, and past the stranded-wait look (3 s)
    assert json.loads(dist_kernel.ok(_STATES).stdout) == {"0": "ok", "1": "ok"}
    dist_kernel.ok("background.wait(); print('waited')")
    dist_kernel.ok("%%on_all_ranks\nassert t.item() == 2")
