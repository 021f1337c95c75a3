"""Is the live dashboard still smooth in the browser at 8 ranks x 10k steps?

JupyterLab (this checkout's extension) in headless Debian Chromium runs one notebook:
``%dist_start R --cpu`` and a cell whose ranks each log S steps (``nbdist.log(step=,
loss=, samples=)``, a 1 ms sleep per step). While the cell runs, the benchmark times how
long the page makes a caller wait (a trivial ``page.evaluate``, every 0.2 s: what a
click or key press would wait) and reads, in the page, the longest the main thread went
without running a 50 ms timer and the longest one dashboard update took. After the
cell: seconds until every rank's last step is on the loss plot, and the points the
plot holds (the dashboard decimates to a budget, so the browser draws a bounded number
whatever the run's length).

The baseline, in the same run on the same page set-up: 2 ranks x 1k steps. The figures
print side by side with their ratios (large run / baseline).

Runs in its own process (the place of a user's browser and Jupyter server); needs the
``ui`` test extra and Debian's chromium (``scripts/test.sh tests/ui`` installs both).

Usage: python bench/dashboard_browser.py [--ranks 8] [--steps 10000] [--base-ranks 2]
       [--base-steps 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import load, machine  # noqa: E402

from tests.ui.conftest import CHROMIUM, CHROMIUM_FLAGS, notebook_json  # noqa: E402
from tests.ui.lab import start_lab, stop_lab  # noqa: E402
from tests.ui.labbuild import labextension_build, link_labextension  # noqa: E402
from tests.ui.test_dashboard_browser import STALL_MONITOR  # noqa: E402

LOSS_TRACES = """() => {
    const div = document.querySelector('.nbdist-dashboard .nbdist-panel[data-key="loss"]');
    return div && div.data ? div.data.map(t => ({n: t.x.length, last: t.x[t.x.length - 1]})) : [];
}"""


def _notebook(ranks: int, steps: int) -> dict:
    cell = (
        "%%on_all_ranks\nimport time\nimport nbdist\n"
        f"for i in range({steps}):\n"
        "    nbdist.log(step=i, loss=1.0 / (1.0 + 0.01 * i) + 0.01 * rank, samples=64)\n"
        "    time.sleep(0.001)\n"
        "print('LOGGED', i)"
    )
    return notebook_json(["%load_ext nbdist", f"%dist_start {ranks} --cpu", cell, "%dist_stop"])


def _kernel_ready(server) -> bool:
    return any(k["execution_state"] == "idle" and k["connections"] >= 1 for k in server.kernels())


def _wait(predicate, timeout: float, what: str, tick=None):
    deadline = time.monotonic() + timeout
    while True:
        if tick is not None:
            tick()
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out: {what}")
        time.sleep(0.2)


def measure(pw, tmp: Path, ranks: int, steps: int) -> dict:
    """One notebook in a fresh JupyterLab and Chromium profile; the page's figures."""
    root = tmp / f"root-{ranks}x{steps}"
    root.mkdir()
    (root / "scale.ipynb").write_text(json.dumps(_notebook(ranks, steps)))
    server = start_lab(
        tmp / f"jupyter-{ranks}x{steps}",
        root,
        tmp / f"server-{ranks}x{steps}.log",
        link_labextension(tmp / "labextensions"),
    )
    context = pw.chromium.launch_persistent_context(
        user_data_dir=str(tmp / f"profile-{ranks}x{steps}"),
        executable_path=CHROMIUM,
        headless=True,
        args=CHROMIUM_FLAGS,
        viewport={"width": 1400, "height": 1000},
    )
    try:
        page = context.pages[0] if context.pages else context.new_page()
        page.goto(f"{server.url}lab/tree/scale.ipynb?token={server.token}")
        page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60_000)
        _wait(lambda: _kernel_ready(server), 60, "the notebook's kernel")
        page.locator("li.lm-MenuBar-item", has_text="Run").click()
        page.locator("li.lm-Menu-item[data-command='runmenu:run-all']").click()
        page.evaluate(STALL_MONITOR)
        answers: list[float] = []

        def answer() -> None:
            began = time.monotonic()
            page.evaluate("() => 1")
            answers.append(time.monotonic() - began)

        dashboard = page.locator(".nbdist-dashboard")
        _wait(lambda: dashboard.count() > 0, 180, "no dashboard appeared", answer)
        logged = page.locator(".jp-OutputArea-output", has_text="LOGGED")
        began = time.monotonic()
        _wait(lambda: logged.count() > 0, 900, "the logging cell did not end", answer)
        cell_s = time.monotonic() - began
        ended = time.monotonic()

        def complete():
            traces = page.evaluate(LOSS_TRACES)
            done = len(traces) >= ranks and all(t["last"] == steps - 1 for t in traces[:ranks])
            return traces if done else None

        traces = _wait(complete, 120, "the loss plot did not reach the last step", answer)
        caught_up = time.monotonic() - ended
        stats = page.evaluate("() => nbdistDashboardStats")
        return {
            "ranks": ranks,
            "steps": steps,
            "cell_s": cell_s,
            "answers": len(answers),
            "slowest_answer_s": max(answers),
            "stall_s": page.evaluate("() => window.__nbdistStall.max") / 1000,
            "longest_update_ms": stats["longestUpdateMs"],
            "deltas": stats["deltas"],
            "caught_up_s": caught_up,
            "points_per_trace": max(t["n"] for t in traces[:ranks]),
        }
    finally:
        context.close()
        left = stop_lab(server)
        if left:
            print("left behind by JupyterLab:", left)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--base-ranks", type=int, default=2)
    parser.add_argument("--base-steps", type=int, default=1_000)
    args = parser.parse_args()
    if not Path(CHROMIUM).exists():
        raise SystemExit(f"{CHROMIUM} not found: `bash scripts/test.sh tests/ui` installs it")
    from playwright.sync_api import sync_playwright

    os.environ["PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD"] = "1"
    labextension_build()
    print(machine())
    print(f"load before: {load()}")
    with tempfile.TemporaryDirectory(prefix="nbdist-bench-dash-") as tmp, sync_playwright() as pw:
        base = measure(pw, Path(tmp), args.base_ranks, args.base_steps)
        big = measure(pw, Path(tmp), args.ranks, args.steps)
    print(f"load after: {load()}")
    # (label, key, format, ratio printed): counts and durations of the cell itself differ by
    # design between the two sizes; the page's latencies are what should not grow.
    rows = [
        ("dashboard shown until the cell ended (s)", "cell_s", "{:.1f}", False),
        ("page answers sampled", "answers", "{}", False),
        ("slowest page answer (s)", "slowest_answer_s", "{:.2f}", True),
        ("longest main-thread stall (s)", "stall_s", "{:.2f}", True),
        ("longest dashboard update (ms)", "longest_update_ms", "{:.0f}", True),
        ("dashboard updates received", "deltas", "{}", False),
        ("last step on the plot after the cell (s)", "caught_up_s", "{:.2f}", True),
        ("points per loss trace drawn", "points_per_trace", "{}", True),
    ]
    head_base = f"{base['ranks']}x{base['steps']}"
    head_big = f"{big['ranks']}x{big['steps']}"
    print(f"{'':42} {head_base:>12} {head_big:>12} {'ratio':>7}")
    for label, key, fmt, with_ratio in rows:
        a, b = base[key], big[key]
        r = f"{b / a:.2f}x" if a and with_ratio else ""
        print(f"{label:42} {fmt.format(a):>12} {fmt.format(b):>12} {r:>7}")


if __name__ == "__main__":
    main()
