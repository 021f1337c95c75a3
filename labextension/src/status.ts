/**
 * The status-bar item of the active notebook's kernel:
 * "nbdist · 2 ranks · gloo · step 1180–1200 · 3.1k samples/s", or a dead-rank warning.
 *
 * The step is the range over the live ranks (a lagging rank shows as a range, not hidden
 * behind the highest step); the rate is the server's total of the ranks that logged in
 * the last seconds, so it disappears once training stops instead of going stale.
 */
import { INotebookTracker } from '@jupyterlab/notebook';
import { ISignal, Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { ClusterModel, ICluster } from './api';
import { compact } from './charts';

export function statusText(cluster: ICluster | null): string {
  if (!cluster) {
    return '';
  }
  if (cluster.dead.length) {
    const ranks = cluster.dead.join(', ');
    return `nbdist · ⚠ ${cluster.dead.length === 1 ? 'rank' : 'ranks'} ${ranks} dead of ${cluster.world_size}`;
  }
  const parts = [`nbdist · ${cluster.world_size} ranks · ${cluster.backend ?? '?'}`];
  const { step_min: lo, step_max: hi } = cluster;
  if (lo !== null && hi !== null) {
    parts.push(lo === hi ? `step ${hi}` : `step ${lo}–${hi}`);
  }
  if (cluster.samples_per_s !== null) {
    const unit = cluster.rate_key === 'tokens_per_s' ? 'tokens/s' : 'samples/s';
    parts.push(`${compact(cluster.samples_per_s)} ${unit}`);
  }
  return parts.join(' · ');
}

export class StatusItem extends Widget {
  constructor(
    private model: ClusterModel,
    private tracker: INotebookTracker
  ) {
    super();
    this.addClass('nbdist-statusbar');
    this.addClass('jp-StatusBar-TextItem');
    model.changed.connect(this._update, this);
    tracker.currentChanged.connect(this._update, this);
    this._update();
  }

  /** Whether the status bar should show the item (a cluster for the active notebook). */
  get active(): boolean {
    return this._active;
  }

  dispose(): void {
    this.model.changed.disconnect(this._update, this);
    this.tracker.currentChanged.disconnect(this._update, this);
    super.dispose();
  }

  private _update(): void {
    const kernel = this.tracker.currentWidget?.sessionContext.session?.kernel;
    const cluster = this.model.forKernel(kernel?.id);
    this.node.textContent = statusText(cluster);
    this.node.title = cluster
      ? 'nbdist cluster of this notebook (steps: lowest–highest of the live ranks): see the nbdist sidebar'
      : '';
    this.node.classList.toggle('nbdist-status-dead', !!cluster && cluster.dead.length > 0);
    const active = cluster !== null;
    if (active !== this._active) {
      this._active = active;
      this._activeChanged.emit();
    }
  }

  /** Emitted when the item appears or disappears (the status bar re-checks ``active``). */
  get activeChanged(): ISignal<this, void> {
    return this._activeChanged;
  }

  private _active = false;
  private _activeChanged = new Signal<this, void>(this);
}
