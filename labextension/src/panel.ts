/**
 * The left-sidebar panel: every nbdist cluster of this Jupyter server, its ranks,
 * small live charts, actions (with confirmation) and the past runs of the history.
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { ServiceManager } from '@jupyterlab/services';
import { Widget } from '@lumino/widgets';

import { act, Action, ClusterModel, ICluster, IRankRow, IRunRecord, requestAPI } from './api';
import { compact, lineChart } from './charts';

const ACTIONS: { action: Action; label: string; title: string; body: string }[] = [
  {
    action: 'interrupt',
    label: 'Interrupt',
    title: 'Interrupt all ranks?',
    body: 'Sends SIGINT to every rank: the running cell stops with KeyboardInterrupt on each rank; the ranks stay up.'
  },
  {
    action: 'restart',
    label: 'Restart',
    title: 'Restart the ranks?',
    body: 'Fresh engines and a new process group, same number of ranks; the rank namespaces start empty. Runs in the notebook’s kernel after its current cell (interrupt first to restart now).'
  },
  {
    action: 'stop',
    label: 'Stop',
    title: 'Stop the cluster?',
    body: 'Stops every process nbdist started for this notebook (as %dist_stop). Runs in the notebook’s kernel after its current cell.'
  }
];

type Column = keyof IRankRow | 'seen' | 'gpu_util' | 'gpu_mem' | 'gpu_temp';

const COLUMNS: [Column, string][] = [
  ['rank', 'rank'],
  ['host', 'host'],
  ['device', 'device'],
  ['state', 'state'],
  ['step', 'step'],
  ['loss', 'loss'],
  ['samples_per_s', 'samples/s'],
  ['memory_mib', 'MiB'],
  ['seen', 'seen']
];

// Shown before "seen" only when some rank of the cluster reported a GPU.
const GPU_COLUMNS: [Column, string][] = [
  ['gpu', 'GPU'],
  ['gpu_util', 'util'],
  ['gpu_mem', 'GPU mem'],
  ['gpu_temp', 'temp']
];

// Shown after samples/s only when some rank of the cluster logged flops.
const FLOPS_COLUMNS: [Column, string][] = [
  ['tflops', 'TFLOP/s'],
  ['mfu', 'MFU']
];

function columnsFor(cluster: ICluster): [Column, string][] {
  const rate = COLUMNS.findIndex(([key]) => key === 'samples_per_s') + 1;
  const flops = cluster.ranks.some(r => r.tflops !== undefined) ? FLOPS_COLUMNS : [];
  const gpu = cluster.ranks.some(r => r.gpu) ? GPU_COLUMNS : [];
  return [...COLUMNS.slice(0, rate), ...flops, ...COLUMNS.slice(rate, -1), ...gpu, ...COLUMNS.slice(-1)];
}

function figure(value: number | null | undefined, unit: string): string {
  return value === null || value === undefined ? '?' : `${value.toFixed(0)}${unit}`;
}

function gib(mib: number | null): string {
  return mib === null ? '?' : (mib / 1024).toFixed(1);
}

function ago(seconds: number | null): string {
  if (seconds === null) {
    return '–';
  }
  const dt = Math.max(0, Date.now() / 1000 - seconds);
  return dt < 60 ? `${dt.toFixed(0)} s` : dt < 3600 ? `${(dt / 60).toFixed(0)} min` : `${(dt / 3600).toFixed(1)} h`;
}

function cell(row: IRankRow, key: string): string {
  switch (key) {
    case 'seen':
      return ago(row.last_seen);
    case 'loss':
      return compact(row.loss);
    case 'samples_per_s':
      return compact(row.samples_per_s);
    case 'tflops':
      return compact(row.tflops);
    case 'mfu':
      return row.mfu === null || row.mfu === undefined ? '–' : `${(100 * row.mfu).toFixed(1)} %`;
    case 'memory_mib':
      return row.memory_mib === null ? '–' : row.memory_mib.toFixed(0);
    case 'gpu':
      return row.gpu ? figure(row.gpu.index, '') : '–';
    case 'gpu_util':
      return row.gpu ? figure(row.gpu.util, ' %') : '–';
    case 'gpu_mem':
      return row.gpu ? `${gib(row.gpu.mem_used_mib)}/${gib(row.gpu.mem_total_mib)} GiB` : '–';
    case 'gpu_temp':
      return row.gpu ? figure(row.gpu.temp_c, ' °C') : '–';
    default: {
      const value = (row as any)[key];
      return value === null || value === undefined ? '–' : String(value);
    }
  }
}

export class ClusterPanel extends Widget {
  constructor(
    private model: ClusterModel,
    private services: ServiceManager.IManager,
    private openRun: (run: IRunRecord) => void
  ) {
    super();
    this.id = 'nbdist-sidebar';
    this.addClass('nbdist-sidebar');
    this.title.caption = 'nbdist: clusters, ranks and live metrics';
    const heading = document.createElement('h2');
    heading.textContent = 'nbdist clusters';
    this._status = document.createElement('div');
    this._status.className = 'nbdist-status-line';
    this._list = document.createElement('div');
    this._list.className = 'nbdist-clusters';
    const runsHead = document.createElement('h3');
    runsHead.textContent = 'Past runs';
    const refresh = document.createElement('button');
    refresh.className = 'jp-Button nbdist-runs-refresh';
    refresh.textContent = '↻';
    refresh.title = 'Refresh the list of runs';
    refresh.onclick = () => void this._loadRuns();
    runsHead.appendChild(refresh);
    this._runs = document.createElement('ul');
    this._runs.className = 'nbdist-runs';
    this.node.append(heading, this._status, this._list, runsHead, this._runs);
    model.changed.connect(this._render, this);
    this._render();
  }

  protected onAfterShow(): void {
    void this.model.refresh();
    void this._loadRuns();
  }

  dispose(): void {
    this.model.changed.disconnect(this._render, this);
    super.dispose();
  }

  private _notebookOf(kernelId: string | null): string | null {
    if (!kernelId) {
      return null;
    }
    for (const session of this.services.sessions.running()) {
      if (session.kernel?.id === kernelId) {
        return session.path;
      }
    }
    return null;
  }

  private _render(): void {
    if (!this.isVisible && this._sections.size > 0) {
      return; // hidden: nothing to redraw (the poll stands by when the tab is hidden)
    }
    const clusters = this.model.clusters;
    this._status.textContent = this.model.error
      ? `Cannot reach the nbdist server extension: ${this.model.error}`
      : clusters.length
        ? ''
        : 'No nbdist cluster is running. In a notebook: %load_ext nbdist, then %dist_start.';
    const seen = new Set<string>();
    for (const cluster of clusters) {
      seen.add(cluster.id);
      let section = this._sections.get(cluster.id);
      if (!section) {
        section = this._section(cluster);
        this._sections.set(cluster.id, section);
        this._list.appendChild(section);
      }
      this._update(section, cluster);
    }
    for (const [id, section] of this._sections) {
      if (!seen.has(id)) {
        section.remove();
        this._sections.delete(id);
      }
    }
    // A new run (a cluster started or restarted) belongs in "Past runs" too.
    const runs = clusters.map(c => String(c.run_id)).join(',');
    if (runs !== this._runIds) {
      this._runIds = runs;
      void this._loadRuns();
    }
  }

  private _section(cluster: ICluster): HTMLElement {
    const section = document.createElement('section');
    section.className = 'nbdist-cluster';
    section.dataset.clusterId = cluster.id;
    const head = document.createElement('div');
    head.className = 'nbdist-cluster-head';
    const title = document.createElement('div');
    title.className = 'nbdist-cluster-title';
    const buttons = document.createElement('div');
    buttons.className = 'nbdist-actions';
    for (const spec of ACTIONS) {
      const button = document.createElement('button');
      button.className = `jp-Button nbdist-action nbdist-${spec.action}`;
      button.textContent = spec.label;
      button.onclick = () => void this._confirm(section.dataset.clusterId!, spec);
      buttons.appendChild(button);
    }
    head.append(title, buttons);
    const message = document.createElement('div');
    message.className = 'nbdist-message';
    const table = document.createElement('table');
    table.className = 'nbdist-ranks';
    table.createTHead().insertRow();
    table.createTBody();
    const wrap = document.createElement('div');
    wrap.className = 'nbdist-ranks-wrap'; // a narrow sidebar scrolls the table sideways
    wrap.appendChild(table);
    const charts = document.createElement('div');
    charts.className = 'nbdist-charts';
    section.append(head, message, wrap, charts);
    return section;
  }

  private _update(section: HTMLElement, cluster: ICluster): void {
    const notebook = this._notebookOf(cluster.kernel_id);
    const where = notebook ?? (cluster.kernel_id ? `kernel ${cluster.kernel_id.slice(0, 8)}` : 'script');
    const run = cluster.run_id === null ? '' : ` · run ${cluster.run_id}`;
    section.querySelector('.nbdist-cluster-title')!.textContent =
      `${where} · ${cluster.world_size} ranks · ${cluster.backend ?? '?'}${run}`;
    section.classList.toggle('nbdist-has-dead', cluster.dead.length > 0);
    const columns = columnsFor(cluster);
    const header = section.querySelector('thead')!.rows[0];
    const keys = columns.map(([key]) => key).join(' ');
    if (header.dataset.columns !== keys) {
      // GPU columns come (or go) with the first (or last) GPU reading; TFLOP/s and MFU with flops
      header.dataset.columns = keys;
      header.replaceChildren(
        ...columns.map(([key, label]) => {
          const th = document.createElement('th');
          th.className = `nbdist-col-${key}`;
          th.textContent = label;
          return th;
        })
      );
    }
    const body = section.querySelector('tbody')!;
    while (body.rows.length > cluster.ranks.length) {
      body.deleteRow(-1);
    }
    cluster.ranks.forEach((row, i) => {
      const tr = body.rows[i] ?? body.insertRow();
      tr.className = `nbdist-rank nbdist-state-${row.state}`;
      tr.dataset.rank = String(row.rank);
      tr.dataset.state = row.state;
      while (tr.cells.length > columns.length) {
        tr.deleteCell(-1);
      }
      columns.forEach(([key], j) => {
        const td = tr.cells[j] ?? tr.insertCell();
        td.className = `nbdist-col-${key}`;
        td.textContent = cell(row, key);
        if (key.startsWith('gpu') && row.gpu && row.gpu.time !== null) {
          td.title = `GPU ${figure(row.gpu.index, '')}, read ${ago(row.gpu.time)} ago (the whole GPU's figures)`;
        } else {
          td.removeAttribute('title');
        }
      });
    });
    const charts = section.querySelector('.nbdist-charts')!;
    const width = Math.max(180, Math.min(320, this.node.clientWidth - 24));
    charts.replaceChildren(
      lineChart(new Map(cluster.ranks.map(r => [r.rank, r.loss_series])), {
        title: 'loss',
        width,
        height: 90,
        className: 'nbdist-chart-loss'
      }),
      lineChart(new Map(cluster.ranks.map(r => [r.rank, r.throughput_series])), {
        title: 'samples/s',
        width,
        height: 90,
        className: 'nbdist-chart-throughput'
      })
    );
  }

  private async _confirm(clusterId: string, spec: (typeof ACTIONS)[number]): Promise<void> {
    const result = await showDialog({
      title: spec.title,
      body: spec.body,
      buttons: [
        Dialog.cancelButton(),
        spec.action === 'interrupt'
          ? Dialog.okButton({ label: spec.label })
          : Dialog.warnButton({ label: spec.label })
      ]
    });
    if (!result.button.accept) {
      return;
    }
    const message = this._sections.get(clusterId)?.querySelector('.nbdist-message');
    try {
      const reply = await act(clusterId, spec.action);
      if (message) {
        message.textContent =
          reply.via === 'pid'
            ? `SIGINT sent to ${reply.pids.length} rank processes`
            : `${spec.label} requested through the notebook’s kernel`;
      }
    } catch (err) {
      if (message) {
        message.textContent = `${spec.label} failed: ${(err as Error).message}`;
      }
    }
    void this.model.refresh();
  }

  private async _loadRuns(): Promise<void> {
    let runs: IRunRecord[];
    try {
      runs = (await requestAPI<{ runs: IRunRecord[] }>('runs')).runs;
    } catch (err) {
      this._runs.textContent = `Cannot read the run history: ${(err as Error).message}`;
      return;
    }
    this._runs.replaceChildren();
    if (!runs.length) {
      const li = document.createElement('li');
      li.textContent = 'No runs in the history yet.';
      this._runs.appendChild(li);
    }
    for (const run of runs.slice().reverse().slice(0, 50)) {
      const li = document.createElement('li');
      const link = document.createElement('button');
      link.className = 'nbdist-run-link';
      link.dataset.runId = String(run.id);
      const when = new Date(run.started * 1000).toLocaleString();
      link.textContent = `run ${run.id} · ${run.world_size} ranks · ${run.backend || '?'} · ${run.points} points · ${when}${run.ended ? '' : ' · running'}`;
      link.onclick = () => this.openRun(run);
      li.appendChild(link);
      this._runs.appendChild(li);
    }
  }

  private _sections = new Map<string, HTMLElement>();
  private _runIds = '';
  private _status: HTMLElement;
  private _list: HTMLElement;
  private _runs: HTMLElement;
}
