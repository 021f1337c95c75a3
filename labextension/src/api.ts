/**
 * The nbdist server extension's REST API, and one shared poller of the live clusters.
 *
 * Why polling rather than a websocket: each poll is one small read of the
 * cluster registry and the run history on the server; it goes through the
 * server's usual authentication and XSRF checks, works unchanged behind
 * JupyterHub and other proxies, needs no reconnection logic across server
 * restarts, and costs nothing while nobody looks. The poll runs every second
 * while JupyterLab is visible and stands by while the browser tab is hidden
 * (the dask-labextension / ipyparallel pattern); after errors it backs off.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

export interface IRankRow {
  rank: number;
  host: string | null;
  pid: number | null;
  device: string | null;
  state: 'busy' | 'idle' | 'dead';
  /** A local rank's process that runs nothing until let go (its cell waits); absent otherwise. */
  process?: 'stopped' | 'held by a debugger';
  step: number | null;
  points: number;
  loss: number | null;
  samples_per_s: number | null;
  memory_mib: number | null;
  last_seen: number | null;
  loss_series: [number, number][];
  throughput_series: [number, number][];
  /** The rank's GPU, as its latest reading gave it; absent on a rank without a GPU. */
  gpu?: IGpuReading;
  /** Latest achieved TFLOP/s and MFU (a fraction of the peak); absent unless the rank logs flops. */
  tflops?: number;
  mfu?: number | null;
  /** Why the rank is a straggler, by the dashboard's rule; '' when it is not (a dead rank never is). */
  straggler: string;
}

/** One GPU's figures (the whole GPU's: ranks sharing it show the same); null: not reported. */
export interface IGpuReading {
  index: number | null;
  util: number | null;
  mem_used_mib: number | null;
  mem_total_mib: number | null;
  temp_c: number | null;
  time: number | null;
}

export interface ICluster {
  id: string;
  kernel_id: string | null;
  backend: string | null;
  world_size: number;
  run_id: number | null;
  owned: boolean;
  started: number | null;
  ranks: IRankRow[];
  /** Lowest and highest step of the ranks that are not dead: a lagging rank shows. */
  step_min: number | null;
  step_max: number | null;
  /** Total rate of the ranks that logged in the last seconds; null once training stops. */
  samples_per_s: number | null;
  /** What the rates count. */
  rate_key: 'samples_per_s' | 'tokens_per_s';
  dead: number[];
  /** Above 8 ranks: counts by state, a row per host and the deviating ranks (not a card per rank). */
  summary?: IClusterSummary;
  /** Above 8 ranks: the median across the living ranks at each step, per chart. */
  median?: { loss_series: [number, number][]; throughput_series: [number, number][] };
}

/** Per state, the ranks counted in it whose processes are held: ``{busy: {stopped: 1}}``. */
export interface IHeldCounts {
  [state: string]: { [word: string]: number };
}

/** A host's ranks in the summary: counted by state, their step range and total rate now. */
export interface IHostSummary {
  host: string;
  ranks: number;
  states: { [state: string]: number };
  held?: IHeldCounts;
  step_min: number | null;
  step_max: number | null;
  samples_per_s: number | null;
}

/** The summary the sidebar shows above 8 ranks (nbdist/server/rank_summary.py). */
export interface IClusterSummary {
  states: { busy: number; idle: number; dead: number };
  held?: IHeldCounts;
  hosts: IHostSummary[];
  /** Dead first, then stragglers, then the odd state out; ``why`` says which. */
  deviating: { rank: number; host: string; why: string }[];
  /** Deviating ranks left out of the list. */
  more: number;
}

export interface IRunRecord {
  /** Counted from 1 in every history file: a run is named by its ``history`` and its id. */
  id: number;
  /** The history file the run is in (the default one, or a live cluster's own ``history=``). */
  history: string;
  started: number;
  ended: number | null;
  world_size: number;
  backend: string;
  label: string;
  host: string;
  points: number;
  /** True while a live cluster logs to it; a run whose kernel died is finished (ended may be null). */
  running: boolean;
}

/** A history's file name (``run.history`` is its path): tells two runs of one id apart at a glance. */
export function historyName(history: string): string {
  return history.split(/[\\/]/).pop() || history;
}

/** A metric's chart titles, as the notebook dashboard writes them. */
export interface IPanel {
  title: string;
  unit: string;
  ytitle: string;
  xtitle: string;
  log: boolean;
  /** Plotted against seconds since the run started (throughput, GPU), not step. */
  by_time: boolean;
}

export interface IRunSeries {
  id: number;
  history: string;
  started: number;
  ended: number | null;
  world_size: number;
  backend: string;
  keys: string[];
  series: { [key: string]: { [rank: string]: [number, number | null][] } }; // null: a gap
  panels: { [key: string]: IPanel };
  running: boolean;
  /** Above 8 ranks: the ranks ``series`` holds, the deviating ones, and why each. */
  shown?: { rank: number; why: string }[];
  /** Above 8 ranks: per chart, the median, min and max across every rank. */
  bands?: { [key: string]: { median: [number, number][]; min: [number, number][]; max: [number, number][] } };
}

export type Action = 'interrupt' | 'restart' | 'stop';

/** A request to ``{baseUrl}nbdist/api/{path}``; rejects with the server's message. */
export async function requestAPI<T>(path: string, init: RequestInit = {}): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'nbdist', 'api', path);
  const response = await ServerConnection.makeRequest(url, init, settings);
  const text = await response.text();
  let data: any = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = text;
  }
  if (!response.ok) {
    const message = (data && data.message) || response.statusText;
    throw new ServerConnection.ResponseError(response, message);
  }
  return data as T;
}

export function act(clusterId: string, action: Action): Promise<any> {
  return requestAPI(`clusters/${encodeURIComponent(clusterId)}/${action}`, {
    method: 'POST',
    body: '{}'
  });
}

/**
 * The rank colours, from the server (``nbdist/api/palette``): the notebook dashboard
 * and the comparison chart draw ranks in the same ones. Until the list arrives, a rank
 * is drawn in the text colour.
 */
export class Palette {
  /** Rank ``rank``'s colour; the list repeats. */
  colour(rank: number): string {
    const n = this._colours.length;
    return n ? this._colours[rank % n] : 'currentColor';
  }

  get loaded(): boolean {
    return this._colours.length > 0;
  }

  /** Read the palette once (again after a failure); resolves to whether it is loaded. */
  async load(): Promise<boolean> {
    if (!this._colours.length) {
      try {
        this._colours = (await requestAPI<{ colours: string[] }>('palette')).colours;
      } catch {
        return false; // the next poll tries again
      }
    }
    return true;
  }

  private _colours: string[] = [];
}

/** The live clusters, polled once for every view that shows them. */
export class ClusterModel {
  constructor() {
    this._poll = new Poll({
      auto: true,
      factory: () => this._refresh(),
      frequency: { interval: 1000, backoff: true, max: 30 * 1000 },
      name: 'nbdist:clusters',
      standby: 'when-hidden'
    });
  }

  /** The rank colours every view of this page uses. */
  readonly palette = new Palette();

  get clusters(): ICluster[] {
    return this._clusters;
  }

  /** The message of the last failed poll, or '' when the last poll worked. */
  get error(): string {
    return this._error;
  }

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  forKernel(kernelId: string | null | undefined): ICluster | null {
    if (!kernelId) {
      return null;
    }
    return this._clusters.find(c => c.kernel_id === kernelId) ?? null;
  }

  /** Poll now (after an action), instead of at the next tick. */
  refresh(): Promise<void> {
    return this._poll.refresh();
  }

  dispose(): void {
    this._poll.dispose();
  }

  private async _refresh(): Promise<void> {
    try {
      await this.palette.load();
      const reply = await requestAPI<{ clusters: ICluster[] }>('clusters');
      this._clusters = reply.clusters;
      this._error = '';
    } catch (err) {
      this._error = String((err as Error).message || err);
      this._changed.emit();
      throw err; // the poll backs off
    }
    this._changed.emit();
  }

  private _clusters: ICluster[] = [];
  private _error = '';
  private _changed = new Signal<this, void>(this);
  private _poll: Poll;
}
