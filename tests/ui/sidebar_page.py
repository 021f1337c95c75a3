"""Page helpers for the sidebar's browser test: what it samples, measures and clicks."""

from __future__ import annotations

import re
from pathlib import Path

from tests.ui.conftest import poll
from tests.ui.contrast import text_contrast_failures

# Every sample while the cell runs: the toolbar indicator, the status bar's kernel item,
# the cells' prompts and whether the cell's dashboard widget is on the page.
KERNEL_SAMPLER = """() => {
  window.__kernelSamples = [];
  window.__kernelSampler = setInterval(() => {
    const indicator = document.querySelector('.jp-NotebookPanel .jp-Notebook-ExecutionIndicator');
    const item = [...document.querySelectorAll('.jp-StatusBar-TextItem')]
      .find(e => e.textContent.includes('(ipykernel) | '));
    window.__kernelSamples.push({
      toolbar: indicator ? indicator.dataset.status : null,
      statusbar: item ? item.textContent : null,
      prompts: [...document.querySelectorAll('.jp-NotebookPanel .jp-Cell .jp-InputPrompt')]
        .map(p => p.textContent.trim()),
      dashboard: !!document.querySelector('.jp-NotebookPanel .nbdist-dashboard'),
    });
  }, 100);
}"""

OUTSIDE = """() => {
  const bar = document.querySelector('#nbdist-sidebar');
  const box = bar.getBoundingClientRect();
  const out = [];
  if (bar.scrollWidth > bar.clientWidth + 1) out.push(`scrolls sideways: ${bar.scrollWidth} > ${bar.clientWidth}`);
  for (const el of bar.querySelectorAll('tr.nbdist-rank td, .nbdist-chart-box, .nbdist-legend-item')) {
    if (getComputedStyle(el).display === 'none') continue;
    const r = el.getBoundingClientRect();
    if (!r.width || r.left < box.left - 0.5 || r.right > box.right + 0.5) {
      out.push(`${el.className} "${el.textContent.slice(0, 24)}": ${r.left.toFixed(0)}-${r.right.toFixed(0)}, sidebar ${box.left.toFixed(0)}-${box.right.toFixed(0)}`);
    }
  }
  return out;
}"""


def steps(page) -> list[int]:
    texts = page.locator(".nbdist-cluster tr.nbdist-rank td.nbdist-col-step").all_inner_texts()
    return [int(m.group()) if (m := re.search(r"\d+", t)) else -1 for t in texts]


def chart_last_x(page) -> list[int]:
    """The newest step drawn by each rank's line of the sidebar's loss chart."""
    lines = page.locator(".nbdist-cluster svg.nbdist-chart-loss polyline")
    return [int(lines.nth(i).get_attribute("data-last-x") or -1) for i in range(lines.count())]


def sidebar_width(page) -> float:
    return page.locator("#nbdist-sidebar").bounding_box()["width"]


def set_sidebar_width(page, width: int) -> None:
    """Drag the handle between the left sidebar and the main area, as a user would."""
    handle = page.locator("#jp-main-split-panel > .lm-SplitPanel-handle:not(.lm-mod-hidden)").first
    box = handle.bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(x + width - sidebar_width(page), y, steps=10)
    page.mouse.up()
    assert poll(lambda: abs(sidebar_width(page) - width) < 20, timeout=10), sidebar_width(page)


def set_theme(page, name: str, light: bool) -> None:
    """Switch JupyterLab's theme (the Settings > Theme menu's command) and wait until it applies."""
    page.evaluate(
        "name => window.jupyterapp.commands.execute('apputils:change-theme', {theme: name})", name
    )
    background = "rgb(255, 255, 255)" if light else "rgb(33, 33, 33)"  # --jp-layout-color1
    assert poll(
        lambda: (
            page.evaluate(
                "() => getComputedStyle(document.querySelector('#nbdist-sidebar')).backgroundColor"
            )
            == background
        ),
        timeout=30,
    ), f"theme {name} did not apply"
    page.wait_for_selector("#jupyterlab-splash", state="detached", timeout=30_000)


def readable(page, where: str) -> None:
    for selector in ("#nbdist-sidebar", ".nbdist-statusbar", ".nbdist-run-chart"):
        failures = text_contrast_failures(page, selector)
        assert failures == [], f"{where}, {selector}: text below 4.5:1: {failures}"


def shoot(page, artifacts_dir: Path, name: str) -> None:
    page.locator("#nbdist-sidebar").screenshot(path=str(artifacts_dir / f"sidebar-{name}.png"))


def plot_state(page, key: str) -> dict:
    """The run chart's plot of ``key``: traces, visibility, x range, axis titles, title colour."""
    return page.evaluate(
        """key => {
  const el = document.querySelector(`.nbdist-run-plot-${key}`);
  return {
    traces: el.data.map(t => [t.name, t.line.color, t.x.length]),
    visible: el.data.map(t => t.visible),
    x: el._fullLayout.xaxis.range.slice(),
    xtitle: el.querySelector('.g-xtitle').textContent,
    ytitle: el.querySelector('.g-ytitle').textContent,
    titleFill: getComputedStyle(el.querySelector('.gtitle')).fill,
  };
}""",
        key,
    )
