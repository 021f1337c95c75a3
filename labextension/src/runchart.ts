/**
 * A past run of the history in the main area: one interactive chart per logged metric
 * (hover read-out, drag to zoom, double-click to reset, a legend to hide ranks), a line
 * per rank, drawn with the plotly.js the nbdist server extension serves, as the notebook
 * dashboard draws its live charts. Above 8 ranks, as on the dashboard: the median across
 * the ranks with their min-max band, and the few ranks that deviate on their own, each in
 * a colour of its own, so the legend stays short. Titles and axes come from the server (the dashboard's
 * names for each metric), rank colours from its palette, and every other colour from
 * JupyterLab's theme variables, read again whenever the theme changes.
 *
 * Without plotly.js (the server extension could not find plotly) the charts are the
 * sidebar's static SVG ones, and a line says why.
 */
import { MainAreaWidget } from '@jupyterlab/apputils';
import { PageConfig, URLExt } from '@jupyterlab/coreutils';
import type { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { historyName, IRunRecord, IRunSeries, Palette, requestAPI } from './api';
import { lineChart, rankLegend, Series } from './charts';
import { MEDIAN } from './summary';

const PLOT_HEIGHT = 300;

let plotlyPromise: Promise<any> | null = null;

/** plotly.js: the page's, else the one the nbdist server extension serves. */
export function loadPlotly(): Promise<any> {
  const w = window as any;
  if (w.Plotly) {
    return Promise.resolve(w.Plotly);
  }
  if (!plotlyPromise) {
    plotlyPromise = new Promise((resolve, reject) => {
      const script = document.createElement('script');
      script.src = URLExt.join(PageConfig.getBaseUrl(), 'nbdist', 'static', 'plotly.min.js');
      // An AMD loader on the page would take the UMD bundle instead of window.Plotly.
      const amd = w.define;
      w.define = undefined;
      const finish = (error: Error | null) => {
        w.define = amd;
        if (!error && w.Plotly) {
          resolve(w.Plotly);
        } else {
          plotlyPromise = null; // the next view tries again
          reject(error ?? new Error('plotly.min.js did not define window.Plotly'));
        }
      };
      script.onload = () => finish(null);
      script.onerror = () => finish(new Error(`could not load ${script.src}`));
      document.head.appendChild(script);
    });
  }
  return plotlyPromise;
}

interface ITheme {
  fg: string;
  grid: string;
  hoverBg: string;
  font: string;
}

/** JupyterLab's theme colours, as they apply to ``el`` now. */
function readTheme(el: HTMLElement): ITheme {
  const style = getComputedStyle(el);
  const v = (name: string) => style.getPropertyValue(name).trim();
  return {
    fg: v('--jp-ui-font-color1') || style.color,
    grid: v('--jp-border-color2') || 'rgba(128, 128, 128, 0.3)',
    hoverBg: v('--jp-layout-color1') || style.backgroundColor,
    font: v('--jp-ui-font-family') || style.fontFamily
  };
}

class RunChart extends Widget {
  constructor(
    private record: IRunRecord,
    private palette: Palette
  ) {
    super();
    this.addClass('nbdist-run-chart');
    this.node.textContent = `Loading run ${record.id}…`;
    void this._load();
  }

  dispose(): void {
    this._themeWatch.disconnect();
    window.clearTimeout(this._retry);
    if (this._plotly) {
      for (const plot of this._plots) {
        this._plotly.purge(plot);
      }
    }
    super.dispose();
  }

  protected onResize(msg: Widget.ResizeMessage): void {
    super.onResize(msg);
    this._resize();
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this._resize();
  }

  private _resize(): void {
    if (this._plotly && this.isVisible) {
      for (const plot of this._plots) {
        this._plotly.Plots.resize(plot);
      }
    }
  }

  private async _load(): Promise<void> {
    let run: IRunSeries;
    try {
      // The run of its own history: another history has a run of the same id.
      const query = URLExt.objectToQueryString({ history: this.record.history });
      const path = `runs/${this.record.id}${query}`;
      [run] = await Promise.all([requestAPI<IRunSeries>(path), this.palette.load()]);
    } catch (err) {
      this.node.textContent = `Cannot read run ${this.record.id}: ${(err as Error).message}`;
      return;
    }
    this._run = run;
    const head = document.createElement('div');
    head.className = 'nbdist-run-head';
    const started = new Date(run.started * 1000).toLocaleString();
    const ended = run.running
      ? 'still running'
      : run.ended
        ? new Date(run.ended * 1000).toLocaleString()
        : 'finished (its kernel ended it without a time)';
    head.textContent = `run ${run.id} · ${run.world_size} ranks · ${run.backend || '?'} · ${started} → ${ended}`;
    head.title = `run ${run.id} of the history ${run.history}`;
    const note = document.createElement('div');
    note.className = 'nbdist-run-note';
    const grid = document.createElement('div');
    grid.className = 'nbdist-run-grid';
    this.node.replaceChildren(head, note, grid);
    if (!run.keys.length) {
      grid.textContent = 'This run logged no points.';
      return;
    }
    try {
      this._plotly = await loadPlotly();
    } catch (err) {
      note.textContent = `Static charts: plotly.js did not load (${(err as Error).message}).`;
      this._drawStatic(grid, run);
      return;
    }
    note.textContent = 'Hover for values, drag to zoom, double-click to zoom out, click a rank to hide or show it.';
    // One legend for every chart (as on the dashboard); a click hides or shows the rank everywhere.
    const legend = rankLegend(this._ranks(), rank => this._colour(rank), rank => this._name(rank));
    legend.querySelectorAll<HTMLElement>('.nbdist-legend-item').forEach(item => {
      const why = run.shown?.find(s => s.rank === Number(item.dataset.rank))?.why;
      if (why) {
        item.title = why;
      }
      item.setAttribute('role', 'button');
      item.setAttribute('aria-pressed', 'false');
      item.tabIndex = 0;
      item.onclick = () => this._toggle(Number(item.dataset.rank), item);
      item.onkeydown = (e: KeyboardEvent) => {
        if (e.key === 'Enter' || e.key === ' ') {
          this._toggle(Number(item.dataset.rank), item);
        }
      };
    });
    grid.before(legend);
    for (const key of run.keys) {
      const plot = document.createElement('div');
      plot.className = `nbdist-run-plot nbdist-run-plot-${key}`;
      plot.dataset.key = key;
      grid.appendChild(plot);
      this._plots.push(plot);
    }
    this._draw();
    // JupyterLab marks a theme change on <body>; the new theme's CSS may land a moment later,
    // so the colours are compared until they change.
    this._themeWatch.observe(document.body, {
      attributes: true,
      attributeFilter: ['data-jp-theme-name', 'data-jp-theme-light']
    });
  }

  /** The legend's entries: every rank, or above 8 ranks the median band and the ranks shown. */
  private _ranks(): number[] {
    const run = this._run!;
    if (run.bands) {
      return [MEDIAN, ...(run.shown ?? []).map(s => s.rank)];
    }
    return Array.from({ length: run.world_size }, (_, i) => i);
  }

  /** A rank's colour: its own up to 8 ranks; above, by its place among the few shown. */
  private _colour(rank: number): string {
    const run = this._run!;
    if (!run.bands) {
      return this.palette.colour(rank);
    }
    if (rank === MEDIAN) {
      return 'currentColor';
    }
    return this.palette.colour(Math.max(0, (run.shown ?? []).findIndex(s => s.rank === rank)));
  }

  private _name(rank: number): string {
    return rank === MEDIAN ? 'median, min–max of the ranks' : `rank ${rank}`;
  }

  private _traces(key: string, theme: ITheme): any[] {
    const run = this._run!;
    const perRank = run.series[key] ?? {};
    const x = run.panels[key]?.by_time ? '%{x:.1f} s' : 'step %{x}';
    const lines: any[] = [];
    const band = run.bands?.[key];
    if (band) {
      const visible = this._hidden.has(MEDIAN) ? 'legendonly' : true;
      const trace = (name: string, points: [number, number | null][]) => ({
        type: 'scatter',
        mode: 'lines',
        name,
        visible,
        x: points.map(p => p[0]),
        y: points.map(p => p[1]),
        hovertemplate: `${name}<br>${x}: %{y:.4g}<extra></extra>`
      });
      // min, then max filled down to it: the band every rank lies in; the median over it.
      const edge = { width: 0.5, color: 'rgba(128,128,128,0.6)' };
      lines.push(
        { ...trace('min of the ranks', band.min), line: edge },
        { ...trace('max of the ranks', band.max), line: edge, fill: 'tonexty', fillcolor: 'rgba(128,128,128,0.22)' },
        { ...trace('median of the ranks', band.median), line: { width: 2.5, color: theme.fg } }
      );
    }
    const ranks = Object.keys(perRank)
      .map(Number)
      .sort((a, b) => a - b);
    for (const rank of ranks) {
      lines.push({
        type: 'scatter',
        mode: 'lines',
        name: `rank ${rank}`,
        visible: this._hidden.has(rank) ? 'legendonly' : true,
        x: perRank[String(rank)].map(p => p[0]),
        y: perRank[String(rank)].map(p => p[1]),
        line: { color: this._colour(rank), width: band ? 1.6 : 1.5 },
        hovertemplate: `rank ${rank}<br>${x}: %{y:.4g}<extra></extra>`
      });
    }
    return lines;
  }

  private _plotLayout(key: string, theme: ITheme): any {
    const panel = this._run!.panels[key];
    const axis = { gridcolor: theme.grid, zerolinecolor: theme.grid, linecolor: theme.grid, automargin: true };
    const lines = [...Object.values(this._run!.series[key] ?? {}), ...Object.values(this._run!.bands?.[key] ?? {})];
    const positive = lines.every(points => points.every(p => p[1] === null || p[1] > 0)); // null: a gap
    return {
      title: { text: panel?.title ?? key, font: { size: 13 } },
      height: PLOT_HEIGHT,
      autosize: true,
      margin: { l: 8, r: 12, t: 40, b: 8 },
      xaxis: { ...axis, title: { text: panel?.xtitle ?? 'step' } },
      yaxis: { ...axis, title: { text: panel?.ytitle ?? key }, type: panel?.log && positive ? 'log' : 'linear' },
      showlegend: false, // the one HTML legend above the charts
      font: { color: theme.fg, size: 11, family: theme.font },
      hoverlabel: { bgcolor: theme.hoverBg, font: { color: theme.fg } },
      paper_bgcolor: 'rgba(0,0,0,0)',
      plot_bgcolor: 'rgba(0,0,0,0)',
      uirevision: key // a theme change keeps the user's zoom
    };
  }

  private _draw(): void {
    const theme = readTheme(this.node);
    this._themeKey = JSON.stringify(theme);
    for (const plot of this._plots) {
      const key = plot.dataset.key!;
      void this._plotly.react(plot, this._traces(key, theme), this._plotLayout(key, theme), {
        displaylogo: false,
        responsive: true
      });
    }
  }

  private _toggle(rank: number, item: HTMLElement): void {
    if (!this._hidden.delete(rank)) {
      this._hidden.add(rank);
    }
    item.classList.toggle('nbdist-legend-off', this._hidden.has(rank));
    item.setAttribute('aria-pressed', String(this._hidden.has(rank)));
    this._draw();
  }

  private _onThemeChange(tries = 20): void {
    window.clearTimeout(this._retry);
    if (JSON.stringify(readTheme(this.node)) !== this._themeKey) {
      this._draw();
    } else if (tries > 0) {
      this._retry = window.setTimeout(() => this._onThemeChange(tries - 1), 150);
    }
  }

  private _drawStatic(grid: HTMLElement, run: IRunSeries): void {
    const colour = (rank: number) => this._colour(rank);
    const name = (rank: number) => this._name(rank);
    grid.before(rankLegend(this._ranks(), colour, name));
    for (const key of run.keys) {
      const series: Series = new Map();
      const median = run.bands?.[key]?.median;
      if (median) {
        series.set(MEDIAN, median);
      }
      for (const [rank, points] of Object.entries(run.series[key] ?? {})) {
        series.set(Number(rank), points);
      }
      const panel = run.panels[key];
      grid.appendChild(
        lineChart(series, {
          title: panel?.title ?? key,
          xtitle: panel?.xtitle ?? 'step',
          ytitle: panel?.ytitle ?? key,
          width: 460,
          height: 220,
          className: `nbdist-chart-${key}`,
          colour,
          name
        })
      );
    }
  }

  private _run: IRunSeries | null = null;
  private _plotly: any = null;
  private _plots: HTMLElement[] = [];
  private _hidden = new Set<number>();
  private _themeKey = '';
  private _retry = 0;
  private _themeWatch = new MutationObserver(() => this._onThemeChange());
}

const historyNumbers = new Map<string, number>();

/**
 * The id of the chart widget of ``record`` (unique in the page): every history numbers
 * its runs from 1, so the id names the history too (by a number kept for the page's life).
 */
export function runWidgetId(record: IRunRecord): string {
  let n = historyNumbers.get(record.history);
  if (n === undefined) {
    n = historyNumbers.size;
    historyNumbers.set(record.history, n);
  }
  return `nbdist-run-${n}-${record.id}`;
}

export function runChartWidget(record: IRunRecord, palette: Palette): MainAreaWidget<Widget> {
  const widget = new MainAreaWidget({ content: new RunChart(record, palette) });
  widget.id = runWidgetId(record);
  widget.title.label = `nbdist run ${record.id} · ${historyName(record.history)}`;
  widget.title.caption = `run ${record.id} of the history ${record.history}`;
  widget.title.closable = true;
  return widget;
}
