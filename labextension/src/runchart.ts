/**
 * A past run of the history in the main area: one chart per logged metric, a line per rank.
 */
import { MainAreaWidget } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { IRunRecord, IRunSeries, requestAPI } from './api';
import { lineChart, rankColour } from './charts';

class RunChart extends Widget {
  constructor(private record: IRunRecord) {
    super();
    this.addClass('nbdist-run-chart');
    this.node.textContent = `Loading run ${record.id}…`;
    void this._load();
  }

  private async _load(): Promise<void> {
    let run: IRunSeries;
    try {
      run = await requestAPI<IRunSeries>(`runs/${this.record.id}`);
    } catch (err) {
      this.node.textContent = `Cannot read run ${this.record.id}: ${(err as Error).message}`;
      return;
    }
    const head = document.createElement('div');
    head.className = 'nbdist-run-head';
    const started = new Date(run.started * 1000).toLocaleString();
    const ended = run.ended ? new Date(run.ended * 1000).toLocaleString() : 'still running';
    head.textContent = `run ${run.id} · ${run.world_size} ranks · ${run.backend || '?'} · ${started} → ${ended}`;
    const legend = document.createElement('div');
    legend.className = 'nbdist-legend';
    for (let rank = 0; rank < run.world_size; rank++) {
      const item = document.createElement('span');
      item.textContent = `■ rank ${rank}`;
      item.style.color = rankColour(rank);
      legend.appendChild(item);
    }
    const grid = document.createElement('div');
    grid.className = 'nbdist-run-grid';
    for (const key of run.keys) {
      const series = new Map<number, [number, number][]>();
      for (const [rank, points] of Object.entries(run.series[key] ?? {})) {
        series.set(Number(rank), points);
      }
      grid.appendChild(
        lineChart(series, { title: `${key} vs step`, width: 460, height: 220, className: `nbdist-chart-${key}` })
      );
    }
    if (!run.keys.length) {
      grid.textContent = 'This run logged no points.';
    }
    this.node.replaceChildren(head, legend, grid);
  }
}

export function runChartWidget(record: IRunRecord): MainAreaWidget<Widget> {
  const widget = new MainAreaWidget({ content: new RunChart(record) });
  widget.id = `nbdist-run-${record.id}`;
  widget.title.label = `nbdist run ${record.id}`;
  widget.title.closable = true;
  return widget;
}
