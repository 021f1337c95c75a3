/**
 * The left-sidebar panel: every nbdist cluster of this Jupyter server, its ranks,
 * small live charts, actions (with confirmation) and the past runs of the history.
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { ServiceManager } from '@jupyterlab/services';
import { Widget } from '@lumino/widgets';

import { act, Action, ClusterModel, historyName, ICluster, IRunRecord, requestAPI } from './api';
import { lineChart, rankLegend } from './charts';
import { rankTable, updateRankTable } from './ranks';
import { drawnRanks, MEDIAN, summaryBox, updateSummary } from './summary';

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

// How long a message such as "SIGINT sent to 2 rank processes" stays under the cluster's title.
const MESSAGE_MS = 8000;

// Charts go side by side from this width of the panel's content (px), one per line below.
const TWO_CHARTS_PX = 460;

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

  /** Add another section (e.g. the named sessions) above the past runs. */
  addSection(node: HTMLElement): void {
    this.node.insertBefore(node, this._runs.previousSibling);
  }

  protected onResize(msg: Widget.ResizeMessage): void {
    super.onResize(msg);
    this._render(); // the charts take the new width now, not at the next poll
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
    // A cluster that starts, restarts or stops changes which runs run: list them again.
    // (The cluster's id too: two clusters' histories may each have a run of that id.)
    const runs = clusters.map(c => `${c.id}:${c.run_id}`).join(',');
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
    message.setAttribute('role', 'status');
    const wrap = document.createElement('div');
    wrap.className = 'nbdist-ranks-wrap';
    wrap.appendChild(rankTable());
    const summary = summaryBox(); // above 8 ranks, instead of the cards
    wrap.appendChild(summary);
    const legend = document.createElement('div');
    legend.className = 'nbdist-legend-slot';
    const charts = document.createElement('div');
    charts.className = 'nbdist-charts';
    // Where the pointer is over the charts: each redraw replaces them, and then shows the
    // hover read-out again at the same place.
    charts.addEventListener('mousemove', e => {
      charts.dataset.pointer = `${e.clientX},${e.clientY}`;
    });
    charts.addEventListener('mouseleave', () => delete charts.dataset.pointer);
    section.append(head, message, wrap, legend, charts);
    return section;
  }

  private _update(section: HTMLElement, cluster: ICluster): void {
    const notebook = this._notebookOf(cluster.kernel_id);
    const where = notebook ?? (cluster.kernel_id ? `kernel ${cluster.kernel_id.slice(0, 8)}` : 'script');
    const run = cluster.run_id === null ? '' : ` · run ${cluster.run_id}`;
    section.querySelector('.nbdist-cluster-title')!.textContent =
      `${where} · ${cluster.world_size} ranks · ${cluster.backend ?? '?'}${run}`;
    section.classList.toggle('nbdist-has-dead', cluster.dead.length > 0);
    const message = section.querySelector<HTMLElement>('.nbdist-message')!;
    if (message.textContent && Date.now() - Number(message.dataset.shownAt ?? 0) > MESSAGE_MS) {
      message.textContent = ''; // a message is news once, not a state
    }
    const many = cluster.summary !== undefined && cluster.median !== undefined;
    const drawn = many ? drawnRanks(cluster) : [];
    // Many ranks: the few drawn on their own take distinct colours, by their place in the list.
    const colour = many
      ? (rank: number) => (rank === MEDIAN ? 'currentColor' : this.model.palette.colour(Math.max(0, drawn.indexOf(rank))))
      : (rank: number) => this.model.palette.colour(rank);
    const name = (rank: number) => (rank === MEDIAN ? 'median of the ranks' : `rank ${rank}`);
    const table = section.querySelector<HTMLTableElement>('table.nbdist-ranks')!;
    const summary = section.querySelector<HTMLElement>('.nbdist-summary')!;
    table.hidden = many;
    summary.hidden = !many;
    if (many) {
      updateSummary(summary, cluster, colour);
    } else {
      updateRankTable(table, cluster, colour);
    }
    const series = (key: 'loss_series' | 'throughput_series') =>
      many
        ? new Map<number, [number, number][]>([
            [MEDIAN, cluster.median![key]],
            ...cluster.ranks.filter(r => drawn.includes(r.rank)).map(r => [r.rank, r[key]] as [number, [number, number][]])
          ])
        : new Map(cluster.ranks.map(r => [r.rank, r[key]]));

    const ranks = many ? [MEDIAN, ...drawn] : cluster.ranks.map(r => r.rank);
    const slot = section.querySelector<HTMLElement>('.nbdist-legend-slot')!;
    const legendKey = `${ranks.join(',')}|${ranks.map(colour).join(',')}`;
    if (slot.dataset.key !== legendKey) {
      slot.dataset.key = legendKey;
      slot.replaceChildren(rankLegend(ranks, colour, name));
    }
    const charts = section.querySelector<HTMLElement>('.nbdist-charts')!;
    const room = Math.max(160, charts.clientWidth || this.node.clientWidth - 24);
    const width = room >= TWO_CHARTS_PX ? Math.floor((room - 8) / 2) : room;
    const rate = cluster.rate_key === 'tokens_per_s' ? 'tokens/s' : 'samples/s';
    charts.replaceChildren(
      lineChart(series('loss_series'), {
        title: many ? 'loss (median)' : 'loss per rank',
        xtitle: 'step',
        ytitle: 'loss',
        width,
        height: 120,
        className: 'nbdist-chart-loss',
        colour,
        name
      }),
      lineChart(series('throughput_series'), {
        title: many ? 'throughput (median)' : 'throughput per rank',
        xtitle: 'step',
        ytitle: rate,
        width,
        height: 120,
        className: 'nbdist-chart-throughput',
        colour,
        name
      })
    );
    if (charts.dataset.pointer) {
      const [clientX, clientY] = charts.dataset.pointer.split(',').map(Number);
      document
        .elementFromPoint(clientX, clientY)
        ?.dispatchEvent(new MouseEvent('mousemove', { clientX, clientY, bubbles: true }));
    }
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
    const message = this._sections.get(clusterId)?.querySelector<HTMLElement>('.nbdist-message');
    const show = (text: string) => {
      if (message) {
        message.textContent = text;
        message.dataset.shownAt = String(Date.now());
      }
    };
    try {
      const reply = await act(clusterId, spec.action);
      show(
        reply.via === 'pid'
          ? `SIGINT sent to ${reply.pids.length} rank processes`
          : `${spec.label} requested through the notebook’s kernel`
      );
    } catch (err) {
      show(`${spec.label} failed: ${(err as Error).message}`);
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
    const several = new Set(runs.map(run => run.history)).size > 1;
    for (const run of runs.slice().reverse().slice(0, 50)) {
      const li = document.createElement('li');
      const link = document.createElement('button');
      link.className = 'nbdist-run-link';
      // A run is (history, id): every history numbers its runs from 1.
      link.dataset.runId = String(run.id);
      link.dataset.history = run.history;
      link.title = `run ${run.id} of the history ${run.history}`;
      const when = new Date(run.started * 1000).toLocaleString();
      // Running only while a live cluster logs to it: a run whose kernel died is finished.
      link.dataset.state = run.running ? 'running' : 'finished';
      // With runs of more than one history listed, each names its history's file.
      const where = several ? ` · ${historyName(run.history)}` : '';
      link.textContent = `run ${run.id}${where} · ${run.world_size} ranks · ${run.backend || '?'} · ${run.points} points · ${when} · ${run.running ? 'running' : 'finished'}`;
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
